"""ListOps (Nangia & Bowman 2018; the LRA version): generator, vocabulary and TSV reader.

The LRA release cannot be downloaded here, so this re-implements the published generator: a node is a digit
with probability 0.75 (always at ``max_depth``), else MAX, MIN, MED (median, floored) or SM (sum mod 10) of
2..``max_args`` sub-trees; a length counts digits, operators and closing brackets, and only ``min_length <
length < max_length`` is kept (LRA: 500 < length < 2000, depth 10, 10 args, 96k / 2k / 2k examples). Files
are the release's: a ``Source<TAB>Target`` header, then expressions as it prints them
(``( ( ( [MAX 2 ) 9 ) ] )``).
"""

from __future__ import annotations

import csv
import io
import random
import statistics
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

from ..run.checkpoint import write_atomic
from ..run import errors
from ..run.cli import parse
from ..run.options import AT_LEAST_1, Range, check_numbers
from .dataset import regular_file

OPERATORS = ("[MIN", "[MAX", "[MED", "[SM")
END = "]"
# Token ids: 0 is padding; parentheses of the release's format carry no information and are dropped.
VOCAB = ("<pad>",) + tuple(str(d) for d in range(10)) + OPERATORS + ("[FIRST", "[LAST", END)
TOKEN_ID = {t: i for i, t in enumerate(VOCAB)}
SPLITS = ("train", "val", "test")


@dataclass
class ListOpsSpec:
    """Generator settings (defaults: the LRA release)."""

    n_train: int = 96000
    """training examples"""
    n_val: int = 2000
    """validation examples"""
    n_test: int = 2000
    """test examples"""
    min_length: int = 500
    """shortest expression, in tokens"""
    max_length: int = 2000
    """longest expression, in tokens"""
    max_depth: int = 10
    """deepest nesting of operators"""
    max_args: int = 10
    """most arguments of one operator"""
    seed: int = 0
    """generator seed"""

    def check(self) -> None:
        check_numbers(self, {**dict.fromkeys(("n_train", "n_val", "n_test", "max_depth"), AT_LEAST_1),
                             "max_args": Range(2)}, prefix="listops.")
        if not 0 <= self.min_length < self.max_length - 1:
            raise ValueError(f"listops needs 0 <= min_length < max_length - 1, got "
                             f"min_length={self.min_length}, max_length={self.max_length}")
        if self.max_length > 4 and self.max_depth < 2:
            raise ValueError("listops.max_depth must be >= 2 to reach lengths above a few tokens")

    def tag(self) -> str:
        return (f"n{self.n_train}-{self.n_val}-{self.n_test}_len{self.min_length}-{self.max_length}"
                f"_d{self.max_depth}_a{self.max_args}_s{self.seed}")


def generate_tree(rng: random.Random, depth: int, spec: ListOpsSpec):
    """(tree, length): a tree is an int or (operator, [children])."""
    if depth >= spec.max_depth or rng.random() > 0.25:
        return rng.randrange(10), 1
    kids = [generate_tree(rng, depth + 1, spec) for _ in range(rng.randint(2, spec.max_args))]
    return (rng.choice(OPERATORS), [c for c, _ in kids]), 2 + sum(n for _, n in kids)


def evaluate(tree) -> int:
    if isinstance(tree, int):
        return tree
    op, children = tree
    vals = [evaluate(c) for c in children]  # [MED: the generator's int(np.median(...)), floored for an even count
    return {"[MIN": min(vals), "[MAX": max(vals), "[SM": sum(vals) % 10, "[MED": int(statistics.median(vals))}[op]


def to_string(tree) -> str:
    """The release's rendering: each application of the operator to one more argument is a pair."""
    if isinstance(tree, int):
        return str(tree)
    op, children = tree
    parts = ["( " * (len(children) + 1) + op + " " + to_string(children[0]) + " )"]
    parts += [" " + to_string(c) + " )" for c in children[1:]]
    return "".join(parts) + " ] )"


def generate(spec: ListOpsSpec) -> dict[str, list[tuple[str, int]]]:
    """Distinct (source, target) examples for each split, by rejection on length as the release."""
    spec.check()
    rng = random.Random(spec.seed)
    total = spec.n_train + spec.n_val + spec.n_test
    seen: dict[str, int] = {}
    tries, limit = 0, 200 * total + 10000
    while len(seen) < total:
        tries += 1
        if tries > limit:
            raise RuntimeError(f"ListOps generator found only {len(seen)} of {total} expressions with "
                               f"{spec.min_length} < length < {spec.max_length} in {limit} tries; "
                               "widen the length range or raise max_depth/max_args")
        tree, length = generate_tree(rng, 1, spec)
        if spec.min_length < length < spec.max_length:
            seen.setdefault(to_string(tree), evaluate(tree))
    items = list(seen.items())
    a, b = spec.n_train, spec.n_train + spec.n_val
    return {"train": items[:a], "val": items[a:b], "test": items[b:]}


def write_dataset(spec: ListOpsSpec, out: str | Path) -> Path:
    out = Path(out)
    data = generate(spec)
    for split in SPLITS:
        text = io.StringIO()
        csv.writer(text, delimiter="\t", lineterminator="\n").writerows([("Source", "Target"), *data[split]])
        write_atomic(out / f"basic_{split}.tsv", text.getvalue(), "ListOps file")
    write_atomic(out / "spec.txt", "".join(f"{k}: {v}\n" for k, v in asdict(spec).items()), "ListOps spec")
    return out


def tokenize(source: str, where: str) -> list[int]:
    """Token ids of one expression (parentheses dropped); ``where`` (file:line) names bad input."""
    ids = []
    for tok in source.split():
        if tok in ("(", ")"):
            continue
        if tok not in TOKEN_ID or tok == "<pad>":
            raise ValueError(f"{where}: unknown ListOps token {tok!r}; expected digits, {', '.join(OPERATORS)}, "
                             f"'{END}' and parentheses")
        ids.append(TOKEN_ID[tok])
    if not ids:
        raise ValueError(f"{where}: empty ListOps expression")
    return ids


def read_tsv(path: str | Path) -> tuple[list[list[int]], list[int]]:
    """Token ids and targets of a release-format ListOps TSV, failing with file:line on bad rows."""
    path = regular_file(Path(path), "ListOps file")
    seqs, targets = [], []
    csv.field_size_limit(1 << 30)  # the module's default (131072 characters) is a traceback for a long expression
    with open(path, newline="", encoding="utf-8", errors="replace") as f:  # a stray byte: an unknown token at file:line
        for lineno, row in enumerate(csv.reader(f, delimiter="\t"), start=1):
            where = f"{path}:{lineno}"
            if lineno == 1:
                if [c.strip() for c in row] != ["Source", "Target"]:
                    raise ValueError(f"{where}: expected the header 'Source<TAB>Target', got {row!r}")
                continue
            if not row:
                continue
            if len(row) != 2:
                raise ValueError(f"{where}: expected 2 tab-separated fields (Source, Target), got {len(row)}")
            try:
                target = int(row[1])
            except ValueError:
                raise ValueError(f"{where}: target {row[1]!r} is not an integer") from None
            if not 0 <= target <= 9:
                raise ValueError(f"{where}: target {target} is outside 0-9")
            seqs.append(tokenize(row[0], where))
            targets.append(target)
    if not seqs:
        raise ValueError(f"{path}: no examples after the header")
    return seqs, targets


@dataclass
class GenerateArgs:

    out: str = "data/listops"
    """directory of basic_train.tsv, basic_val.tsv, basic_test.tsv"""
    spec: ListOpsSpec = field(default_factory=ListOpsSpec)
    """generator settings (spec.n_train=... or n_train=...; defaults: the LRA release)"""


SHORTHANDS = {f.name: f"spec.{f.name}" for f in fields(ListOpsSpec)}
"""``n_train=...`` is ``spec.n_train=...``"""


def main(argv=None) -> None:
    def generate(argv):
        args = parse(GenerateArgs, argv, description=GenerateArgs.__doc__, prog="python -m primal_dt.tasks listops",
                     shorthands=SHORTHANDS)
        with errors.setup_errors(RuntimeError):
            out = write_dataset(args.spec, args.out)
        print(f"wrote {out}/basic_{{train,val,test}}.tsv ({args.spec.n_train}/{args.spec.n_val}/{args.spec.n_test})")

    errors.main(generate, argv)  # a refused write (out= a file, no permission): one line naming the file
