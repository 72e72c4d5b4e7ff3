"""The model's configuration, beside the model: ``model=`` parsed once into a token layout and a stack layout
(the attention core knows no DT names), the attention options parsed once per set of words, token layouts
that say what a stream step can feed them, and no annotation built at run time."""

import ast
import typing
from pathlib import Path

import pytest

from agents import model_config, token_layouts
from agents.model_config import DTConfig, ModelConfig
from agents.token_layouts import TOKEN_LAYOUTS, TokenLayout, parse_name

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("name, tokens, layers", [
    ("dt", "dt", ["softmax"] * 3),
    ("primal+dt", "dt", ["softmax", "softmax", "primal"]),
    ("primalformer-dt", "dt", ["primal"] * 3),
    ("bc", "bc", ["softmax"] * 3),
    ("primal+bc", "bc", ["softmax", "softmax", "primal"]),
    ("linear", "dt", ["linear"] * 3),
    ("primal+linear", "dt", ["linear", "linear", "primal"]),
    ("transformer", "dt", ["softmax"] * 3),
])
def test_a_model_name_is_one_token_layout_and_one_stack(name, tokens, layers):
    cfg = DTConfig(state_dim=11, act_dim=3, name=name)
    assert cfg.tokens == TOKEN_LAYOUTS[tokens] and parse_name(name).tokens == tokens
    assert [s.attention for s in cfg.layer_specs()] == layers
    assert cfg.layer_specs()[-1].options == ({"s": 64} if layers[-1] == "primal" else {})


def test_layer_names_read_the_same_names_and_the_layout_name_picks_the_tokens():
    cfg = DTConfig(state_dim=11, act_dim=3, name="bc", layers="dt,primal+dt,linear,primalformer-dt")
    assert [s.attention for s in cfg.layer_specs()] == ["softmax", "primal", "linear", "primal"]
    assert cfg.tokens == TOKEN_LAYOUTS["bc"]


def test_unknown_names_are_refused_with_the_model_names():
    with pytest.raises(ValueError, match=r"unknown model 'primal\+nope'.* Use dt, bc"):
        ModelConfig(name="primal+nope").check()
    with pytest.raises(ValueError, match="Did you mean 'primalformer-dt'"):
        ModelConfig(name="primalformer-td").check()


def test_the_attention_core_knows_no_decision_transformer_names():
    text = (ROOT / "primal_dt" / "layouts.py").read_text()
    aliases = ast.literal_eval(text.split("ALIASES = ", 1)[1].split("\n\"\"\"", 1)[0])
    assert not {"dt", "bc", "primalformer-dt", *TOKEN_LAYOUTS} & set(aliases)


def test_attention_options_are_parsed_once_per_set_of_words(monkeypatch):
    from agents.train_config import TrainConfig, check
    from agents.training import build_model

    calls = []
    parse = model_config.parse_attention_options
    monkeypatch.setattr(model_config, "parse_attention_options", lambda *a, **k: calls.append(a[0]) or parse(*a, **k))
    model_config._plan.cache_clear()
    cfg = TrainConfig(model=ModelConfig(name="primal+dt", d_model=32, n_heads=2, s=8,
                                        attention_options=("softmax.dropout=0.0",)), K=20, stream_window=5)
    check(cfg)
    assert calls == [("softmax.dropout=0.0",)]
    model = build_model(cfg, 11, 3)  # windowed: the words it writes are parsed once, the user's not again
    assert len(calls) == 2 and "softmax.window=5" in calls[1]
    assert [s.options.get("window") for s in model.stack.specs] == [5, 5, 5]
    build_model(cfg, 11, 3)
    assert len(calls) == 2


def test_a_plan_is_handed_out_as_copies():
    cfg = ModelConfig(name="primal+dt")
    cfg.options()["primal"]["s"] = 3
    cfg.layer_specs()[-1].options["s"] = 3
    assert cfg.options()["primal"]["s"] == 64 and cfg.layer_specs()[-1].options["s"] == 64


def test_a_changed_field_is_checked_again():
    cfg = ModelConfig(d_model=32, n_heads=2)
    cfg.check()
    cfg.n_heads = 3
    with pytest.raises(ValueError, match="model.d_model=32 must be divisible by model.n_heads=3"):
        cfg.check()
    cfg.n_heads, cfg.d_model = 2, [32]  # a value of the wrong kind is refused by name, not by the memo
    with pytest.raises(ValueError, match="model.d_model"):
        cfg.check()


@pytest.mark.parametrize("kinds, predict_from, message", [
    (("state", "rtg", "action"), "state", "known before acting"),
    (("rtg", "action", "state"), "state", "known before acting"),
    (("rtg", "state"), "state", "the action among them"),
    (("rtg", "state", "action", "state"), "state", "each kind once"),
    (("rtg", "state", "action"), "action", "known before acting"),
    (("rtg", "state", "nothing"), "state", "each kind once"),
])
def test_a_token_layout_the_stream_cannot_feed_is_refused(kinds, predict_from, message):
    with pytest.raises(ValueError, match=message):
        TokenLayout(kinds, predict_from)


def test_every_token_kind_is_something_a_stream_step_knows():
    assert all(k.source in token_layouts.STEP_VALUES for k in token_layouts.TOKENS.values())


def test_the_data_source_annotation_is_not_built_when_hints_are_read(monkeypatch):
    from agents import train_config
    from envs import sources

    monkeypatch.setattr(sources, "help_text", lambda: pytest.fail("help text built at run time"))
    hints = typing.get_type_hints(train_config.TrainConfig, include_extras=True)
    assert hints["data_source"] is train_config.DataSource


def test_the_model_does_not_import_the_command_line():
    tree = ast.parse((ROOT / "agents" / "decision_transformer.py").read_text())
    imported = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)} | \
        {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    assert not {"agents.train_config", "train_config", "tyro"} & imported
