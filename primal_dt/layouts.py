"""Named stack layouts: which mechanism each layer uses.

- ``ALIASES``: the papers' names for every layer softmax or every layer primal.
- ``primal+<X>`` (``primal+trans``, ``primal+linear``, ...): backbone X, only the last layer primal (Primal.+X).
- any registered mechanism name: every layer that mechanism.
``options`` maps a mechanism name to its constructor options (e.g. {"primal": {"s": 64}}).
"""

from __future__ import annotations

from .attention import available, get_class
from .blocks import LayerSpec

ALIASES = {"transformer": "softmax", "trans": "softmax", "primalformer": "primal"}
"""the papers' model names for "every layer this mechanism": the one table every command's ``model=`` reads
(a model's own names, such as the Decision Transformer's ``dt``, its model parses first:
``agents.token_layouts``)"""


def canonical(name: str) -> str:
    """The mechanism a layout or layer name stands for (``trans`` -> ``softmax``); other names as given."""
    return ALIASES.get(name, name)


def _mechanism(name: str) -> str:
    name = canonical(name)
    get_class(name)  # raises a clear error listing the registry
    return name


def layout(model: str, n_layers: int, options: dict[str, dict] | None = None) -> list[LayerSpec]:
    if n_layers < 1:
        raise ValueError(f"n_layers must be >= 1, got {n_layers}")
    options = options or {}
    if model.startswith("primal+"):
        names = [_mechanism(model.removeprefix("primal+"))] * (n_layers - 1) + ["primal"]
    else:
        try:
            names = [_mechanism(model)] * n_layers
        except ValueError as err:
            raise ValueError(f"unknown model layout {model!r}: use one of {sorted(ALIASES)}, 'primal+<mechanism>', "
                             f"or a mechanism name ({', '.join(available())})") from err
    return [LayerSpec(n, dict(options.get(n, {}))) for n in names]
