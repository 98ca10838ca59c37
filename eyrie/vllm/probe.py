"""Facts read from what the installed vLLM's code does, run on a CPU on stand-ins.

A substring of a source file says nothing about where a line sits; these run vLLM's own functions
with stand-in arguments and read what comes out:
- `native_ids`: the decoder stack's forward on stub layers, asking for each id in turn;
  a forward that cannot run so is read from its parsed source (ast) instead, and one that
  can't be read either is reported as unknown;
- `default_runner`: VllmConfig.use_v2_model_runner on a stand-in config for the architecture (a
  vLLM without it has one runner: which one, its modules say);
- `chunked_prefill_with_connector`: VllmConfig's check of the KV connector's settings.
What vLLM's draft loaders do with a draft's config: eyrie.vllm.draft_probe.
Each returns (value, how) with value None when unknown; `how` says what was run. Runs in the
vLLM environment (imports torch and vllm inside the functions). See docs/vllm.md.
"""

from __future__ import annotations

import ast
import inspect
import os
import textwrap
from contextlib import contextmanager
from types import SimpleNamespace

STUB_LAYERS = 4  # the stub decoder stack's depth: ids 0..4
CONNECTOR = "ExampleHiddenStatesConnector"


class _Rank:
    """The one pipeline/tensor-parallel rank the stub runs as."""

    is_first_rank = True
    is_last_rank = True
    world_size = 1
    rank_in_group = 0


@contextmanager
def _one_rank():
    """vLLM's pipeline-parallel group replaced by a single rank for the stub forward (nothing to
    replace where vLLM is absent: tests run classes built to mimic it)."""
    try:
        from vllm.distributed import parallel_state
    except ImportError:
        yield
        return

    saved = parallel_state._PP
    parallel_state._PP = _Rank()
    try:
        yield
    finally:
        parallel_state._PP = saved


def _stub_layer(k: int):
    """Layer k of the stub: returns (0, k + 1), so hidden + residual after it is k + 1 = its id."""
    import torch

    def layer(*args, **kwargs):
        return torch.zeros(2, 1), torch.full((2, 1), float(k + 1))

    return layer


def _stub_stack(model_cls, layer_id: int):
    """An instance of the real class (its methods, none of its weights) over stub layers."""
    import torch

    stack = object.__new__(model_cls)
    torch.nn.Module.__init__(stack)
    embed = lambda input_ids: torch.zeros(2, 1)  # noqa: E731  (id 0 is 0)
    values = {
        "layers": [_stub_layer(k) for k in range(STUB_LAYERS)],
        "start_layer": 0,
        "end_layer": STUB_LAYERS,
        "aux_hidden_state_layers": (layer_id,),
        "norm": lambda hidden, residual=None: (hidden, residual),
        "config": SimpleNamespace(),
        "hidden_size": 1,
        "embed_input_ids": embed,
        "get_input_embeddings": embed,
    }
    for name, value in values.items():
        object.__setattr__(stack, name, value)
    return stack


def _run_stub(model_cls, layer_id: int):
    """The ids the forward returns when asked for `layer_id`, or the exception it raised."""
    import torch

    params = list(inspect.signature(model_cls.forward).parameters)[1:]
    args = {
        "input_ids": torch.zeros(2, dtype=torch.long),
        "positions": torch.arange(2),
        "intermediate_tensors": None,
        "inputs_embeds": None,
    }
    with _one_rank():
        out = model_cls.forward(
            _stub_stack(model_cls, layer_id), **{p: args[p] for p in params if p in args}
        )
    if isinstance(out, tuple) and len(out) == 2 and isinstance(out[1], list):
        return [round(float(t.flatten()[0])) for t in out[1]]
    return []


def describe(ids: set[int], n: int = STUB_LAYERS) -> str | None:
    """A set of ids of an n-layer stack as a range of the target's ids: "0..N", "1..N-1", ...;
    "none" for no id; None when the set is not one range."""
    if not ids:
        return "none"
    lo, hi = min(ids), max(ids)
    if ids != set(range(lo, hi + 1)) or hi < n - 1:
        return None
    return f"{lo}..{'N' if hi == n else 'N-1'}"


def native_ids(model_cls) -> tuple[str | None, str]:
    """Which ids the native path returns: the forward run on stubs, else its parsed source."""
    returned, failed = set(), {}
    try:
        for i in range(STUB_LAYERS + 1):
            try:
                got = _run_stub(model_cls, i)
            except TypeError as exc:
                if i != 0:
                    raise
                # id 0, before the first layer, where the residual is None: hidden + None
                failed[i] = f"{type(exc).__name__}: {exc}"
                continue
            if got not in ([], [i]):
                raise ValueError(f"asked for id {i}, got {got}")
            returned.update(got)
        how = f"forward run on a {STUB_LAYERS}-layer stub stack, asking for each id"
        if failed:
            how += f" (id {', '.join(map(str, failed))} raised {next(iter(failed.values()))})"
        desc = describe(returned)
        if desc is not None:
            return desc, how
        return None, f"{how}: ids {sorted(returned)} are not one range"
    except Exception as exc:  # noqa: BLE001  (any failure of the stub: read the source instead)
        stub_error = f"{type(exc).__name__}: {exc}"
    desc, how = native_ids_from_source(model_cls)
    return desc, f"{how} (the stub forward failed: {stub_error})"


def native_ids_from_source(model_cls) -> tuple[str | None, str]:
    """Which ids the forward appends, from its ast: capture sites before or after the layer call
    inside the loop over layers, before the loop (id 0) and after it (id N)."""
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(model_cls.forward)))
    except (OSError, TypeError, SyntaxError) as exc:
        return None, f"unknown: the forward's source cannot be read ({exc})"
    body = tree.body[0].body
    loop = next((s for s in body if isinstance(s, ast.For) and _calls_layer_loop(s)), None)
    if loop is None:
        return None, "unknown: no loop over the decoder layers in the forward's source"
    var = _loop_index(loop)
    ids: set[int] = set()
    n = STUB_LAYERS
    before_loop = body[: body.index(loop)]
    after_loop = body[body.index(loop) + 1 :]
    if any(_captures(s) for s in before_loop):
        ids.add(0)
    if any(_captures(s) for s in after_loop):
        ids.add(n)
    call_at = next((i for i, s in enumerate(loop.body) if _calls_layer(s)), None)
    for i, stmt in enumerate(loop.body):
        site = _captures(stmt)
        if not site or call_at is None:
            continue
        offset = _offset(site, var)
        if offset is None:
            return None, f"unknown: a capture site's id ({ast.unparse(site)}) is not the loop index"
        after = i > call_at
        if after and offset == 1:
            ids.update(range(1, n + 1))
        elif not after and offset == 0:
            # before layer 0 the residual is None: a capture of hidden + residual fails there
            ids.update(range(0 if not _adds_residual(stmt) else 1, n))
        else:
            where = "after" if after else "before"
            return None, f"unknown: a capture at layer index + {offset} {where} the layer call"
    return describe(ids), "forward's source (ast): where the loop over the layers appends states"


def _calls_layer_loop(loop: ast.For) -> bool:
    return any(_calls_layer(s) for s in loop.body)


def _calls_layer(stmt) -> bool:
    """`hidden_states, residual = layer(...)`: the decoder layer call."""
    return (
        isinstance(stmt, ast.Assign)
        and isinstance(stmt.value, ast.Call)
        and isinstance(stmt.value.func, ast.Name)
        and stmt.value.func.id == "layer"
    )


def _loop_index(loop: ast.For) -> str | None:
    target = loop.target
    if isinstance(target, ast.Tuple) and target.elts and isinstance(target.elts[0], ast.Name):
        return target.elts[0].id
    return None


def _captures(stmt):
    """The id expression of a capture site in stmt (None: stmt captures nothing): an `if X in
    self.aux_hidden_state_layers:` block, or `self._maybe_add_hidden_state(list, X, ...)`."""
    for node in ast.walk(stmt):
        if (
            isinstance(node, ast.Compare)
            and len(node.ops) == 1
            and isinstance(node.ops[0], ast.In)
            and "aux_hidden_state_layers" in ast.unparse(node.comparators[0])
        ):
            return node.left
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr == "_maybe_add_hidden_state"
            and len(node.args) >= 2
        ):
            return node.args[1]
    return None


def _offset(expr, var: str | None) -> int | None:
    """k for an id expression `var + k` (or `var`); None for anything else."""
    if isinstance(expr, ast.Name) and expr.id == var:
        return 0
    if (
        isinstance(expr, ast.BinOp)
        and isinstance(expr.op, ast.Add)
        and isinstance(expr.left, ast.Name)
        and expr.left.id == var
        and isinstance(expr.right, ast.Constant)
    ):
        return int(expr.right.value)
    return None


def _adds_residual(stmt) -> bool:
    """Whether the captured value is `... + residual` with no None guard."""
    src = ast.unparse(stmt)
    return "+ residual" in src and "residual is not None" not in src


class _PlainModel(SimpleNamespace):
    """A model config for plain text generation: every flag not given (is_diffusion, ...) off."""

    def __getattr__(self, name):
        return None


class _ConfigStandIn(SimpleNamespace):
    """Given attributes, and the real class's methods and properties for the rest."""

    def __init__(self, cls, **attrs):
        super().__init__(**attrs)
        object.__setattr__(self, "_cls", cls)

    def __getattr__(self, name):
        member = inspect.getattr_static(object.__getattribute__(self, "_cls"), name, None)
        if isinstance(member, property):
            return member.fget(self)
        if inspect.isfunction(member):
            return member.__get__(self)
        raise AttributeError(name)


def environment_refusal(env: dict[str, str]) -> str | None:
    """What vLLM's own check of the process environment, run at every engine's start
    (`Platform.validate_environ` from 0.33, `vllm.envs.validate_environ` before; not failing on
    unknown variables, as the engines run it), raises for `env` on top of this process's
    environment (vLLM 0.34 refuses VLLM_USE_V2_MODEL_RUNNER=0: V1 removed); None: accepted,
    or no such check."""
    from vllm import envs
    from vllm.platforms.interface import Platform

    check = getattr(Platform, "validate_environ", None) or getattr(envs, "validate_environ", None)
    if check is None:
        return None
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        check(hard_fail=False)
    except ValueError as exc:
        return str(exc)
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    return None


def default_runner(architecture: str | None) -> tuple[str | None, str]:
    """("v1" | "v2", how) of the model runner vLLM picks for plain generation of this
    architecture with VLLM_USE_V2_MODEL_RUNNER unset; None when this vLLM has no such choice or
    the property cannot run on a stand-in."""
    from vllm.config import VllmConfig

    prop = getattr(VllmConfig, "use_v2_model_runner", None)
    if not isinstance(prop, property):  # one runner only: which one its modules say
        from eyrie.vllm.adapters import V1_RUNNER, V2_RUNNER, runner_modules

        v1, v2 = runner_modules()
        if v2 and not v1:
            return "v2", f"{V1_RUNNER} absent, {V2_RUNNER} present: V2 only (V1 removed)"
        if v1 and not v2:
            return "v1", f"{V1_RUNNER} present, no {V2_RUNNER}: V1 only"
        return None, f"no VllmConfig.use_v2_model_runner, and {V1_RUNNER}: {v1}, {V2_RUNNER}: {v2}"
    names = {
        "model_config": _PlainModel(runner_type="generate", architectures=[architecture]),
        "attention_config": SimpleNamespace(hisparse_config=None),
        "watermark_config": None,
        "speculative_config": None,
        "_get_v2_model_runner_unsupported_features": lambda: [],
    }
    stand_in = _ConfigStandIn(VllmConfig, **names)
    env = os.environ.pop("VLLM_USE_V2_MODEL_RUNNER", None)
    globs = prop.fget.__globals__
    triton = globs.get("HAS_TRITON")
    globs["HAS_TRITON"] = True  # a GPU host has Triton (this CPU environment may not)
    try:
        v2 = prop.fget(stand_in)
    except Exception as exc:  # noqa: BLE001
        return None, f"unknown: VllmConfig.use_v2_model_runner failed on a stand-in ({exc})"
    finally:
        globs["HAS_TRITON"] = triton
        if env is not None:
            os.environ["VLLM_USE_V2_MODEL_RUNNER"] = env
    how = (
        "VllmConfig.use_v2_model_runner on a stand-in config for this architecture "
        "(VLLM_USE_V2_MODEL_RUNNER unset, no unsupported feature)"
    )
    return ("v2" if v2 else "v1"), how


def chunked_prefill_with_connector() -> tuple[bool | None, str]:
    """Whether VllmConfig lets the hidden-states connector run with chunked prefill."""
    from vllm.config import VllmConfig

    check = getattr(VllmConfig, "_post_init_kv_transfer_config", None)
    if check is None:
        return None, "unknown: no VllmConfig._post_init_kv_transfer_config to run"
    stand_in = SimpleNamespace(
        kv_transfer_config=SimpleNamespace(kv_connector=CONNECTOR, kv_connector_extra_config={}),
        scheduler_config=SimpleNamespace(enable_chunked_prefill=True),
        cache_config=SimpleNamespace(kv_offloading_size=None),
    )
    how = "VllmConfig._post_init_kv_transfer_config on a stand-in with chunked prefill on"
    try:
        check(stand_in)
    except ValueError as exc:
        return False, f"{how}: {exc}"
    except Exception as exc:  # noqa: BLE001
        return None, f"unknown: {how} failed otherwise ({type(exc).__name__}: {exc})"
    return True, how


def hybrid_groups() -> tuple[bool | None, str]:
    """Whether the hidden-states connector reads its states from the right KV-cache group when
    the target's layers fall into several (sliding-window and full attention, mamba): the
    connector's own group lookup run on stand-in groups, else which design it has."""
    try:
        from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

        connector = KVConnectorFactory.get_connector_class_by_name(CONNECTOR)
    except (ImportError, AttributeError, ValueError) as exc:
        return None, f"unknown: the {CONNECTOR} class cannot be loaded ({exc})"
    lookup = getattr(connector, "_find_cache_kv_group_id", None)
    if lookup is not None:
        from vllm.v1.kv_cache_interface import HiddenStateCacheSpec

        hidden = object.__new__(HiddenStateCacheSpec)
        groups = [SimpleNamespace(kv_cache_spec=s) for s in (object(), object(), hidden)]
        how = "the connector's KV-cache group lookup run on stand-in groups (sliding, full, states)"
        try:
            found = lookup(SimpleNamespace(kv_cache_groups=groups))
        except Exception as exc:  # noqa: BLE001
            return None, f"unknown: {how} failed ({type(exc).__name__}: {exc})"
        return found == 2, f"{how}: group {found}"
    if not hasattr(connector, "_submit_async_write"):
        # the design that copies the states in save_kv_layer, through its own layer's slots
        return True, "the connector copies the states in save_kv_layer, from its own layer"
    return False, (
        "the connector copies finished requests' states without locating its KV-cache group "
        "(the bug vLLM PR #46301 fixed: zeros for hybrid targets)"
    )
