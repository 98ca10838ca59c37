"""Fixtures every test folder shares: one torch thread (again around each test), no wait on a
stopped SLURM controller, the tiny world (a 4-layer Llama target, its preflight report,
vocabulary map and real hidden-state shards) built once per module that asks for it, the target
folders of each shape, and the tiny config's finished workflow run built once per session.
Builders (tiny models, stage argvs, Snakemake runs) are in tests/support."""

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import torch


@pytest.fixture(scope="session", autouse=True)
def one_thread():
    """Tiny models gain nothing from intra-op threads, and on a shared 2-core machine spinning
    OpenMP workers slow every matmul many times over."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(autouse=True)
def back_to_one_thread():
    """A stage run in this process may set torch's threads (the demo target trains on every
    core the process may use): each test ends with one thread again, so that the next test and
    the next module's fixtures do not run with the threads of the one before; and starts with
    one, after the module fixtures it asks for."""
    if torch.get_num_threads() != 1:
        torch.set_num_threads(1)
    yield
    if torch.get_num_threads() != 1:
        torch.set_num_threads(1)


@pytest.fixture(scope="session", autouse=True)
def no_wait_on_a_stopped_slurm(tmp_path_factory):
    """snakemake-executor-plugin-slurm runs `scontrol show config` when it is imported, that is
    at every `snakemake` start. Where SLURM's client is installed but its controller is down
    (this machine before `scripts/slurm-local.sh up`), scontrol retries the connection for
    MessageTimeout (10 s) before it fails, and every dry run of the suite waits 9 s for nothing.
    There the session points SLURM_CONF at a copy of the configuration with MessageTimeout=1:
    scontrol fails at once, and the plugin goes on as it does on a failure. Where the controller
    answers (.ci/run brings it up) nothing changes; the `slurm` tests skip or fail on a controller
    that is down either way."""
    conf = Path(os.environ.get("SLURM_CONF", "/etc/slurm/slurm.conf"))
    if shutil.which("scontrol") is None or not conf.is_file():
        yield
        return
    try:
        down = subprocess.run(["scontrol", "ping"], capture_output=True, timeout=15).returncode
    except subprocess.TimeoutExpired:
        down = True
    if not down:
        yield
        return
    text = re.sub(r"(?im)^\s*MessageTimeout\s*=.*$", "", conf.read_text())
    quick = tmp_path_factory.mktemp("slurm") / "slurm.conf"
    quick.write_text(text.rstrip("\n") + "\nMessageTimeout=1\n")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("SLURM_CONF", str(quick))
        yield


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """build_world's tiny world (tests/support/train_helpers.py) in a folder of its own: target,
    preflight, vocab, shards, meta, model, samples, tokenizer. A module that needs more defines
    its own `world` on top of this one."""
    from tests.support.train_helpers import build_world

    return build_world(tmp_path_factory.mktemp("world"))


@pytest.fixture(scope="session")
def tiny_run(tmp_path_factory):
    """The tiny config (.test/config.yaml) run to completion through Snakemake once per session
    (the slow tier's whole-DAG tests share it): dry runs against it put back what they change, and
    a test that runs jobs works on tests/support/workflow.py's copy_run of it."""
    from tests.support.workflow import build_tiny_run

    return build_tiny_run(tmp_path_factory.mktemp("tiny_run"))


# ----------------------------------------------------------------------------- targets
# One fixture per shape of target folder, built once per module that asks for it. Those made from
# a tokenizer take the module's own `tok` fixture: its chat tokenizer, trained on its own texts.

CHAT_TARGET_TEXTS = ["What does json.dumps do? It serializes an object to a JSON string."] * 20


@pytest.fixture(scope="module")
def chat_target(tmp_path_factory):
    """A complete tiny Llama target (save_chat_target: 8 layers, 2 attention heads and 1
    key/value head, random weights) with a chat tokenizer of 320 tokens trained on one question
    and answer about json.dumps."""
    from tests.support.train_helpers import save_chat_target

    return save_chat_target(tmp_path_factory.mktemp("target"), CHAT_TARGET_TEXTS)


@pytest.fixture(scope="module")
def chat_target_4_heads(tmp_path_factory):
    """chat_target with 4 attention heads and 2 key/value heads."""
    from tests.support.train_helpers import save_chat_target

    return save_chat_target(
        tmp_path_factory.mktemp("target"),
        CHAT_TARGET_TEXTS,
        num_attention_heads=4,
        num_key_value_heads=2,
    )


@pytest.fixture(scope="module")
def tokenizer_only_target(tok, tmp_path_factory):
    """A target folder holding only the module's tokenizer `tok` and its chat template (all that
    eval-prompts reads of a target)."""
    folder = tmp_path_factory.mktemp("tokenizer") / "target"
    tok.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def config_only_target(tok, tmp_path_factory):
    """The module's tokenizer `tok` beside the config.json of a 2-layer Llama of its vocabulary
    size and no weights (config_only_llama): what the data stages read of a target."""
    from tests.support.models import config_only_llama

    path = tmp_path_factory.mktemp("target")
    tok.save_pretrained(path)
    return config_only_llama(path, len(tok))


@pytest.fixture(scope="module")
def padded_config_only_target(tok, tmp_path_factory):
    """config_only_target with a vocab_size 6 above the tokenizer's (a model whose embedding
    has rows no token uses)."""
    from tests.support.models import config_only_llama

    path = tmp_path_factory.mktemp("target")
    tok.save_pretrained(path)
    return config_only_llama(path, len(tok) + 6)


@pytest.fixture(scope="module")
def random_llama_target(tok, tmp_path_factory):
    """A 2-layer Llama target with random weights (2 attention heads, 1 key/value head) and the
    module's tokenizer `tok`: a model that generates."""
    from tests.support.models import random_model, save_target, tiny_llama

    config = tiny_llama(
        len(tok), tok, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1
    )
    return save_target(tmp_path_factory.mktemp("target"), random_model(config), tok)
