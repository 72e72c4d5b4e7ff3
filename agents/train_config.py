"""Configuration of ``python -m primal_dt.train``: dataclasses, presets, provenance, checks.

Precedence: dataclass defaults < the preset (``configs/dt/<preset>.yaml``, by default the one named like
``env``) < a recipe laid over it < the command line; each value remembers which set it (``describe``).
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass, field
from typing import Annotated, Literal, get_args

import tyro

from envs import sources

from agents import stream_training
from agents.model_config import ModelConfig
from primal_dt.run import cli, presets, runtime
from primal_dt.run.options import AT_LEAST_0, AT_LEAST_1, FRACTION, POSITIVE, Range, RunOptions, check_numbers, check_size
from primal_dt.run.presets import flat

GROUP = "dt"


Engine = Literal["recompute", "stream"]


@dataclass
class RolloutOptions:
    """How a checkpoint is rolled out in its simulator: what training's evaluation (``eval.*``) and
    ``python -m eval.rollout`` share, so both have the same names, types and defaults."""

    targets: tuple[float, ...] = ()
    """return-to-go targets in raw returns, e.g. 3600,1800 (empty: the run's own: its preset's, else the env's)"""
    num_envs: int = 50
    """simulators run side by side (rows of vector envs); never more than the episodes to run"""
    max_steps: int = 0
    """cap on episode length (0: the env's limit, 1000)"""
    engine: Engine = "recompute"
    """recompute: re-run the last K steps each step (the papers' protocol) | stream: recurrent state, O(1) per step
    (the default for a run trained for it, with stream_window, from_start or whole_episodes: its trained policy)"""
    asynchronous: bool = False
    """one subprocess per simulator (AsyncVectorEnv) instead of SyncVectorEnv"""
    lanes: int = 0
    """vector envs the simulators are split into, one stepping while the next one's agent acts (0: 2 sync, 1 async)"""

    def check(self, prefix: str = "") -> None:
        """``prefix``: where these options sit ("eval.")."""
        check_numbers(self, ROLLOUT_NUMBERS, prefix)


ENGINES = get_args(Engine)
ROLLOUT_NUMBERS = {"targets": Range(-1e12, 1e12), "num_envs": AT_LEAST_1, "max_steps": AT_LEAST_0,
                   "lanes": AT_LEAST_0}
"""Returns-to-go reach the model as float32 ``target / reward_scale``, hence the bound on targets."""


@dataclass
class EvalConfig(RolloutOptions):
    """Evaluation in the simulator while training (and at its end)."""

    every: int = 10_000
    """roll out the model in the simulator every this many steps (0: only at the end)"""
    episodes: int = 10
    """episodes per target during training"""
    final_episodes: int = 100
    """episodes per target at the end (0: skip the final evaluation)"""


DataSource = Annotated[str, tyro.conf.arg(help=f"where the dataset comes from: {sources.help_text()}")]
"""``data_source``'s annotation, its help listing the registered sources: built once, here (an f-string in the
annotation itself was built again by every ``get_type_hints``)."""


@dataclass
class TrainConfig(RunOptions):
    env: str = "hopper-medium"
    """dataset and simulator: D4RL naming <family>-<level>, family hopper, halfcheetah, walker2d or ant, level
    random, medium, medium-replay, medium-expert or expert; or a Minari dataset id whose simulator is one of these
    families (mujoco/hopper/medium-v0, a local one)"""
    preset: str = ""
    """configs/dt/<preset>.yaml to start from ('' : the preset named like env, when there is one)"""
    recipe: Literal["preset", "cpu"] = "preset"
    """preset: the preset's settings as they are (a task's are the paper's) | cpu: configs/dt/recipes/cpu.yaml laid
    over them, sized to learn in one run on one CPU core, its time per kind of CPU in docs/cpu.md (the task keeps its
    data and targets)"""
    model: ModelConfig = field(default_factory=ModelConfig)
    steps: int = 100_000
    """optimizer steps"""
    batch_size: int = 64
    """segments per step (global: divided among DDP processes)"""
    K: int = 20
    """context length in environment steps"""
    lr: float = 1e-3
    """AdamW learning rate (after warm-up)"""
    weight_decay: float = 1e-4
    """AdamW weight decay"""
    warmup_steps: int = 10_000
    """linear learning-rate warm-up, then ``lr_schedule``"""
    lr_schedule: Literal["constant", "cosine"] = "constant"
    """after warm-up: constant (the DT recipe) | cosine: down a half cosine to ``lr_min`` x lr at the last step, so
    the last weights come from small steps rather than wherever a full-size step happened to land (the other lever
    beside ``ema_decay`` against a final policy that is a draw). It follows ``steps``: a resumed run given more steps
    stretches what is left of it"""
    lr_min: float = 0.1
    """the cosine schedule's last rate, as a fraction of lr"""
    grad_clip: float = 0.25
    """max gradient norm (0: off)"""
    ema_decay: float = 0.999
    """decay of an exponential moving average of the weights, kept beside them and saved in the checkpoint (0: none).
    It never changes training; ``eval.rollout weights=ema`` evaluates it: an average over the last ~1/(1-decay) steps
    is less a draw of where the last step landed than the raw weights are"""
    eta: float = 0.05
    """weight of the KSVD regulariser (primal layers)"""
    reward_scale: float = 1000.0
    """returns-to-go are divided by this"""
    max_timestep: int = 1000
    """timestep embedding size; timesteps are clipped to max_timestep - 1"""
    stream_window: int = 0
    """stream-exact training (0: off): window every layer to this many tokens and count only the steps
    the stream engine predicts identically (docs/evaluation.md, stream-exact training); needs softmax/primal layers"""
    stream_counts: Literal["protocol", "tail"] = "protocol"
    """which steps a stream_window run's loss counts: protocol (a segment starts its first exact step's worth of
    steps before the step drawn, or at its episode's first, and counts the K - that many from the drawn one: the
    steps a segment of the papers' protocol drawn there counts, each seen exactly) | tail (the first tables': each
    segment drawn as the protocol's counts the steps from its first exact one, or all of it at an episode's
    first step, so the first steps of every episode are counted up to K times less often)"""
    from_start: bool = False
    """train on episode prefixes: every segment starts at its episode's first step, so each prediction sees its
    whole episode so far, as the stream engine does: the stream is then the trained policy for any layout
    (docs/evaluation.md, stream-exact training). Needs K >= max_timestep; the all-linear layouts (primalformer-dt)
    keep an O(1) stream step, softmax layers' stream step costs O(K)"""
    whole_episodes: bool = False
    """train on whole episodes, K steps at a time: batch_size lanes each walk an episode from its first step in
    consecutive K-step chunks, every chunk run through the stream's own recurrent form from the state its episode's
    previous chunk left (no gradient through it). Each prediction then sees its whole episode so far as the stream
    engine does, so the stream is the trained policy, at a K-step segment's cost (docs/evaluation.md, stream-exact
    training). Needs every layer to stream (primalformer-dt: O(1) per step; softmax layers see 3K - 1 tokens)"""
    data_source: DataSource = "auto"
    data_clip_actions: bool = False
    """clip dataset actions outside the simulator's action box into it (default: such data is an error giving
    how many values lie outside and their range)"""
    data_top_fraction: float = 1.0
    """train on this fraction of the training episodes with the highest returns, e.g. 0.1 with model=bc for filtered
    behaviour cloning (CORL's %BC); any model; 1: every episode. Taken after val_fraction's held-out episodes are
    drawn from all of them; the run's name says it (bc-top10%)"""
    val_fraction: float = 0.05
    """share of the dataset's episodes held out (drawn by seed) for validation without a simulator: their masked
    action MSE every eval.every steps and at the end (0: off; at least one episode when > 0)"""
    eval: EvalConfig = field(default_factory=EvalConfig)
    checkpoint_every: int = 10_000
    """write last.pt every this many steps (and always at the end)"""
    checkpoint_minutes: float = 10.0
    """also write last.pt by wall time: first after a minute, then at doubling intervals up to this many minutes,
    so a run stopped after its first minute resumes (0: off)"""
    log_every: int = 100
    """TensorBoard scalars every this many steps"""
    compile: Literal["auto", "eager", "compile", "cudagraphs"] = "auto"
    """the training step's form (same loss and gradients): auto (the measured fastest on the device: eager on a CPU,
    cudagraphs on one GPU, compile under DDP on GPUs) | eager (the reference) | compile (torch.compile, fused AdamW;
    compiles for a minute or more first) | cudagraphs (compile, then the whole step in one CUDA graph; CUDA only)"""
    compile_check: bool = True
    """before a compiled form (compile=compile or cudagraphs) trains, compare its first steps with the eager step's
    on copies; where they differ beyond float rounding, say so and train in the eager step
    (docs/gpu.md#the-compile-check; false: train in the compiled form unchecked)"""
    amp: Literal["off", "bf16", "auto"] = "off"
    """mixed precision of the training step: off (float32) | bf16 (the forward and loss autocast to bfloat16;
    weights, gradients and AdamW stay float32) | auto (the CPU recipe's: bf16 on a CPU with AVX512-BF16 or AMX,
    else off; resolved when the run is configured, so a checkpoint keeps what it trained in). bf16 pays where its
    matmuls are native: GPUs with bf16 tensor cores, such CPUs (docs/cpu.md); elsewhere it is emulated and slower"""
    print_config: bool = False
    """print every option at the start (default: those that differ from the defaults; TensorBoard has all)"""


RESUMABLE = {"steps", "eval", "checkpoint_every", "checkpoint_minutes", "log_every", "threads", "device", "progress",
             "tensorboard", "resume", "print_config", "compile", "compile_check"}
"""what a resumed run may change (everything else comes from the checkpoint)"""


# -- building a config ------------------------------------------------------------------------------
@dataclass
class Built:
    cfg: TrainConfig
    source: str
    """the preset's source line, then the recipe's"""
    provenance: dict[str, str]
    """dotted option -> 'default' | 'preset <name>' | 'recipe <name>' | 'command line'"""


SHORTHANDS = {"model": "model.name", "attention": "model.name"}
"""``model=NAME`` and ``attention=NAME`` are short for ``model.name=NAME``."""


def build(argv: list[str]) -> Built:
    first = cli.peek(TrainConfig, argv, SHORTHANDS, PROG)
    name = first.preset or (first.env if first.env in presets.list_presets(GROUP) else "")
    layers = [(f"preset {name}", presets.load_preset(GROUP, name))] if name else []  # unknown: error with suggestions
    recipe = load_recipe(first.recipe) if first.recipe != "preset" else {}
    if recipe:
        layers.append((f"recipe {first.recipe}", {k: v for k, v in recipe.items() if k != "models"}))
    source = "; ".join(f"{where}: {values.get('source', '(no source line)')}" for where, values in layers) \
        or "(no preset: dataclass defaults)"
    cfg, prov = TrainConfig(), dict.fromkeys(flat(dataclasses.asdict(TrainConfig())), "default")
    for where, values in layers:
        cfg = presets.apply_preset(cfg, values, where=where)
        prov.update(dict.fromkeys(flat({k: v for k, v in values.items() if k not in presets.META_KEYS}), where))
    given = cli.given(TrainConfig, argv, SHORTHANDS)
    model = first.model.name if "model.name" in given else cfg.model.name
    own = model_section(recipe, model, "model.layers" in given or bool(cfg.model.layers))
    if own:
        where = f"recipe {first.recipe} for {model}"
        cfg = presets.apply_preset(cfg, own, where=where)
        prov.update(dict.fromkeys(flat(own), where))
    cfg = cli.parse(TrainConfig, argv, default=cfg, prog=PROG, description=_DESCRIPTION, shorthands=SHORTHANDS)
    if name:
        cfg = dataclasses.replace(cfg, preset=name)
    if cfg.amp == "auto":  # resolved here, once: a sweep, a resume and the checkpoint see what the run trains in
        cfg = dataclasses.replace(cfg, amp="bf16" if runtime.native_bf16(cfg.device) else "off")
    prov.update(dict.fromkeys(cli.given(TrainConfig, argv, SHORTHANDS), "command line"))
    streams = stream_training.trained_for_stream(
        {"stream_window": cfg.stream_window, "from_start": cfg.from_start, "whole_episodes": cfg.whole_episodes})
    if streams and prov.get("eval.engine") == "default":  # the stream is exact for such a run, and O(1) per step
        cfg = dataclasses.replace(cfg, eval=dataclasses.replace(cfg.eval, engine="stream"))
        prov["eval.engine"] = streams
    return Built(cfg, source, prov)


def model_section(recipe: dict, model: str, layout: bool) -> dict:
    """A model's own training in ``recipe`` (its ``models`` section), laid over the recipe for a run of that model by
    name; none for a ``model.layers`` layout (``layout``), which is no named model's measured training."""
    return {} if layout else recipe.get("models", {}).get(model, {})


def load_recipe(name: str) -> dict:
    """A recipe: options laid over whichever preset a run starts from (configs/dt/recipes/<name>.yaml), and, in its
    ``models`` section, options for one model only (model name: options), laid over those when a run trains that
    model by its name (not a ``model.layers`` layout): where a measurement chose a model's training of its own."""
    recipe = presets.load_preset(f"{GROUP}/recipes", name)
    models = recipe.get("models", {})
    path = f"configs/{GROUP}/recipes/{name}.yaml"
    if not isinstance(models, dict) or not all(isinstance(v, dict) for v in models.values()):
        raise ValueError(f"{path}: models must map a model's name to a mapping of its options, got {models!r:.80}")
    for model, options in models.items():
        try:
            ModelConfig(name=str(model)).check()
        except ValueError as err:
            raise ValueError(f"{path}: models.{model} is not a model this package builds: {err}") from None
        if "name" in options.get("model", {}) or "layers" in options.get("model", {}):
            raise ValueError(f"{path}: models.{model} sets the model it is for (model.name or model.layers); its "
                             "options are that model's training")
        presets.apply_preset(TrainConfig(), options, where=f"{path}: models.{model}")  # each option checked by name
    return recipe


PROG = "python -m primal_dt.train"
_DESCRIPTION = ("Train a Decision Transformer (dt | primal+dt | primalformer-dt | any attention mechanism) on an "
                "offline MuJoCo dataset, e.g. env=hopper-medium model=primal+dt seed=3 steps=20000 model.s=64. "
                "model=NAME and attention=NAME are short for model.name=NAME. Defaults shown are those after the "
                "preset (env's or preset=); each run prints every value with where it came from.")


def from_dict(d: dict) -> TrainConfig:
    """A config back from a checkpoint's dict, each value checked against its field; an option this release
    does not have is an error (no release wrote one it has since dropped). A stream_window run from before
    ``stream_counts`` counted segment tails, and resumes so."""
    if isinstance(d, dict) and d.get("stream_window") and "stream_counts" not in d:
        d = {**d, "stream_counts": "tail"}
    return presets.apply_preset(TrainConfig(), d, where="checkpoint config")


def resumed(built: Built, saved: dict, where: str) -> Built:
    """The checkpoint's config plus the ``RESUMABLE`` options of the command line; any other option given
    must agree with the checkpoint (resuming a primal+dt run as dt is an error, not a silent mix)."""
    saved = dataclasses.asdict(from_dict(saved))
    saved_flat, asked = flat(saved), flat(dataclasses.asdict(built.cfg))
    prov = {k: f"checkpoint {where}" for k in saved_flat}
    given = [key for key, came_from in built.provenance.items() if came_from == "command line"]
    presets.refuse_changes(asked, saved_flat, given, RESUMABLE, where)
    for key in given:
        if key.split(".")[0] in RESUMABLE:
            *parents, leaf = key.split(".")
            functools.reduce(dict.__getitem__, parents, saved)[leaf] = asked[key]
            prov[key] = "command line"
    cfg = from_dict(saved)
    return Built(cfg, f"resumed from {where}", prov)


def describe(b: Built, full: bool = False) -> str:
    """The options given or differing from the defaults (``full``: all), each with where it came from."""
    defaults = flat(dataclasses.asdict(TrainConfig()))
    values = flat(dataclasses.asdict(b.cfg))
    shown = {k: v for k, v in values.items()
             if full or b.provenance.get(k) == "command line" or v != defaults.get(k)}
    named = [f"preset {b.cfg.preset}"] * bool(b.cfg.preset) + [f"recipe {b.cfg.recipe}"] * (b.cfg.recipe != "preset")
    origin = b.source if full or b.source.startswith("resumed") else "; ".join(named) or "no preset"
    rest = "" if full else f"; the other {len(values) - len(shown)} at their defaults (print_config=true lists them)"
    lines = [f"config ({origin}){rest}"]
    for k, v in shown.items():
        where = b.provenance.get(k, "default")
        lines.append(f"  {k:<24} = {v!r:<22} [{'checkpoint' if where.startswith('checkpoint ') else where}]")
    return "\n".join(lines)


def model_label(cfg: TrainConfig) -> str:
    """The model's name in run directories, summaries and reports: the layout, or the layers joined by '-', and
    ``-top10%`` when it trained on the best 10 % of the episodes (``data_top_fraction``): a baseline of its own."""
    name = cfg.model.layers.replace(",", "-") if cfg.model.layers else cfg.model.name
    return name if cfg.data_top_fraction >= 1 else f"{name}-top{100 * cfg.data_top_fraction:.4g}%"


# -- checks -------------------------------------------------------------------------------------------
NUMBERS = {
    "steps": AT_LEAST_1, "batch_size": AT_LEAST_1, "K": AT_LEAST_1, "lr": POSITIVE,
    "weight_decay": AT_LEAST_0, "warmup_steps": AT_LEAST_0, "grad_clip": AT_LEAST_0, "eta": AT_LEAST_0,
    "ema_decay": FRACTION, "lr_min": Range(0, 1),
    "reward_scale": Range(1e-6, 1e12), "max_timestep": AT_LEAST_1, "stream_window": AT_LEAST_0,
    "checkpoint_every": AT_LEAST_0, "checkpoint_minutes": Range(0, 1e6), "val_fraction": FRACTION,
    "data_top_fraction": Range(0, 1, low_open=True),
    "log_every": AT_LEAST_0, "eval.every": AT_LEAST_0, "eval.episodes": AT_LEAST_1, "eval.final_episodes": AT_LEAST_0,
}
"""What every numeric option accepts (NaN and inf never); the bound on reward_scale is the targets' (above)."""


def check(cfg: TrainConfig) -> None:
    """Raise ValueError naming the option, its value and what is allowed."""
    m = cfg.model
    RunOptions.check(cfg)
    m.check()
    check_numbers(cfg, NUMBERS)
    cfg.eval.check("eval.")
    layers = len(m.layer_names()) or m.n_layers
    check_size(layers * m.d_model ** 2 * (4 + 2 * m.mlp_ratio) + cfg.max_timestep * m.d_model,
               f"model.d_model={m.d_model}, model.n_layers={layers}, model.mlp_ratio={m.mlp_ratio} and "
               f"max_timestep={cfg.max_timestep}")
    check_size(cfg.batch_size * cfg.K * m.tokens.per_step * m.d_model * layers * 8,
               f"batch_size={cfg.batch_size}, K={cfg.K}, model.d_model={m.d_model} and model.n_layers={layers}",
               "activation values in one training step")
    try:
        sources.parse(cfg.data_source)
    except ValueError as err:
        raise ValueError(f"data_source: {err}") from err
