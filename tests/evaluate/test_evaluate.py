"""eyrie evaluate: speculative outputs equal plain greedy decoding, acceptance metrics on
hand-built proposers with known answers, the EAGLE-3 proposer's alignment against
Eagle3DraftModel.forward, and the CLI (JSON + PNG, one-line errors)."""

from __future__ import annotations

import json
import math

import pytest
import torch

from eyrie import cli as cli
from eyrie.arch.draft import DraftSpec, build_draft
from eyrie.core import errors as ev_errors
from eyrie.core.io import LAST_GOOD
from eyrie.demo.tokenizer import build_chat_tokenizer
from eyrie.evaluate import evaluate as ev
from eyrie.evaluate import specdec as ev_specdec
from eyrie.evaluate.inputs import load_draft
from eyrie.evaluate.specdec import (
    Decoding,
    Eagle3Proposer,
    SpecStats,
    greedy_generate,
    speculative_generate,
    target_step,
    to_target,
)
from tests.support.models import TEXTS, random_model, random_vocab_map, save_target, tiny_llama
from tests.support.stages import stage_args
from tests.support.train_helpers import write_eval_set, write_preflight

AUX = [1, 2, 3]
K = 3
DRAFT_VOCAB = 64


@pytest.fixture(scope="module")
def case(tmp_path_factory):
    """A saved tiny Llama target (+ tokenizer), a vocabulary map, a saved draft and prompts."""
    root = tmp_path_factory.mktemp("evaluate")
    tok = build_chat_tokenizer(TEXTS, vocab_size=300)
    # larger random weights: clear argmax margins, varied greedy outputs
    config = tiny_llama(len(tok), tok, max_position_embeddings=256, tie_word_embeddings=False)
    model = random_model(config, std=0.3)
    target = save_target(root / "target", model, tok)
    vocab, d2t, t2d = random_vocab_map(root / "vocab.safetensors", tok, DRAFT_VOCAB)
    draft = build_draft(target, DraftSpec(AUX), d2t, t2d, seed=1)
    draft.save_pretrained(root / "draft")

    prompts = [
        list(
            tok.apply_chat_template(
                [{"role": "user", "content": t}], add_generation_prompt=True, return_dict=False
            )
        )
        for t in TEXTS[:4]
    ]
    eval_set = write_eval_set(root / "eval.parquet", prompts)
    preflight = write_preflight(root / "preflight.json", target, AUX, 32, len(tok))
    return {
        "root": root,
        "target": target,
        "model": model.eval(),
        "vocab": vocab,
        "d2t": d2t,
        "t2d": t2d,
        "draft": root / "draft",
        "eval_set": eval_set,
        "preflight": preflight,
        "prompts": prompts,
        "eos": tok.eos_token_id,
    }


def oracle(model, wrong_from: int | None = None):
    """Proposes the target's own greedy continuation; positions >= wrong_from are made wrong."""
    vocab = model.config.vocab_size

    def propose(ids, aux, k):
        true = greedy_generate(model, ids.tolist(), k, None)
        if wrong_from is None:
            return true
        return true[:wrong_from] + [(t + 1) % vocab for t in true[wrong_from:]]

    return propose


def test_loaded_draft_equals_saved(case):
    saved = build_draft(
        case["target"], DraftSpec(AUX), case["d2t"], case["t2d"], seed=1
    ).state_dict()
    loaded = load_draft(case["draft"])
    assert loaded.config.eagle_aux_hidden_state_layer_ids == AUX
    for name, value in loaded.state_dict().items():
        if not name.startswith("verifier_"):
            assert torch.equal(value, saved[name]), name


def test_eagle3_outputs_equal_greedy(case):
    model, eos = case["model"], case["eos"]
    draft = build_draft(case["target"], DraftSpec(AUX), case["d2t"], case["t2d"], seed=0)
    propose = Eagle3Proposer(draft)
    stats = SpecStats(K)
    for prompt in case["prompts"]:
        reference = greedy_generate(model, prompt, 12, eos)
        assert (
            speculative_generate(model, prompt, propose, Decoding(K, 12, eos, AUX), stats=stats)
            == reference
        )
    assert stats.num_drafts > 0 and stats.num_draft_tokens == K * stats.num_drafts


def test_hand_built_proposer_outputs_equal_greedy(case):
    model, eos = case["model"], case["eos"]
    calls = []

    def sometimes_right(ids, aux, k):  # right, wrong, right ... with a varying pattern
        calls.append(1)
        true = greedy_generate(model, ids.tolist(), k, None)
        return [
            t if (i + len(calls)) % 2 else (t + 7) % model.config.vocab_size
            for i, t in enumerate(true)
        ]

    for prompt in case["prompts"][:2]:
        for max_new in (1, 2, 9):
            assert speculative_generate(
                model, prompt, sometimes_right, Decoding(K, max_new, eos, AUX)
            ) == greedy_generate(model, prompt, max_new, eos)


def oracle_run(case, prompt: int, max_new: int, wrong_from: int | None = None) -> dict:
    """The metrics of speculative decoding of case["prompts"][prompt] with the oracle proposer,
    whose output must be the target's greedy one."""
    model, ids = case["model"], case["prompts"][prompt]
    stats = SpecStats(K)
    propose = oracle(model, wrong_from=wrong_from)
    out = speculative_generate(model, ids, propose, Decoding(K, max_new, None, AUX), stats=stats)
    assert out == greedy_generate(model, ids, max_new, None)
    return stats.metrics()


def test_oracle_acceptance_is_one_plus_k(case):
    max_new = 13
    m = oracle_run(case, 0, max_new)
    # the prefill gives 1 token, each verification K + 1: ceil(12 / 4) = 3 drafts
    assert m["num_drafts"] == math.ceil((max_new - 1) / (K + 1))
    assert m["acceptance_length"] == 1 + K
    assert m["per_position_acceptance"] == [1.0] * K
    assert m["accepted_tokens"] == K * m["num_drafts"]


def test_always_wrong_proposer(case):
    m = oracle_run(case, 1, 10, wrong_from=0)
    assert m["acceptance_length"] == 1.0
    assert m["per_position_acceptance"] == [0.0] * K
    assert m["num_drafts"] == 9 and m["num_draft_tokens"] == 9 * K


def test_right_on_first_two_of_three(case):
    m = oracle_run(case, 2, 10, wrong_from=2)
    assert m["per_position_acceptance"] == [1.0, 1.0, 0.0]
    assert m["acceptance_length"] == 3.0
    assert m["num_drafts"] == 3  # 1 + 3 * 3 tokens >= 10


def test_step_logits_match_speculators_forward(case):
    """Step 0 (all positions) and step 1 (the appended position) of the proposer equal
    Eagle3DraftModel.forward's TTT steps 0 and 1 on the same inputs."""
    model, prompt = case["model"], case["prompts"][0]
    draft = load_draft(case["draft"])
    propose = Eagle3Proposer(draft)
    ids = torch.tensor(prompt)  # [T]: x_0 .. x_{T-1}
    T = len(ids)
    _, aux = target_step(model, ids, AUX)  # [T, 3H]

    logged = []
    hook = draft.lm_head.register_forward_hook(lambda mod, inp, out: logged.append(out.detach()))
    with torch.no_grad():
        # shift_batch alignment: (x_{t+1}, g_t); the last state has no next token in this batch
        draft_tokens = draft(
            hidden_states=aux[None, :-1],
            input_ids=ids[None, 1:],
            document_ids=torch.zeros(1, T - 1, dtype=torch.long),
            ttt_steps=2,
        )
    hook.remove()
    step0_ref, step1_ref = logged[0][0], logged[1][0]  # [T-1, draft_vocab] each

    with torch.no_grad():
        hidden = propose.fuse(aux[:-1])  # [T-1, H]
        pos = torch.arange(1, T)
        out0 = propose.decode(ids[1:], hidden, pos)  # [T-1, H]
        logits0, carried = propose.head(out0)
        torch.testing.assert_close(logits0, step0_ref, rtol=1e-4, atol=1e-5)
        # through the proposer itself: its first lm_head call is forward's step 0 at the last
        # position, and its first drafted token is forward's draft_tokens[0] there
        seen = []
        hook = draft.lm_head.register_forward_hook(lambda mod, inp, out: seen.append(out.detach()))
        drafted = propose(ids, aux[:-1], 2)
        hook.remove()
        torch.testing.assert_close(seen[0], step0_ref[-1], rtol=1e-4, atol=1e-5)
        assert drafted[0] == int(to_target(propose.draft, draft_tokens[0][0, -1]))
        # step 1 at position p = T-3: context pairs 0..p, then (x_{p+2}, out0[p]) at id p+2,
        # which is what forward's teacher-forced TTT step 1 computes at p
        p = T - 3
        seq_ids = torch.cat([ids[1 : p + 2], ids[p + 2 : p + 3]])
        seq_hidden = torch.cat([hidden[: p + 1], carried[p : p + 1]])
        seq_pos = torch.cat([pos[: p + 1], pos[p : p + 1] + 1])
        logits1, _ = propose.head(propose.decode(seq_ids, seq_hidden, seq_pos)[-1])
        torch.testing.assert_close(logits1, step1_ref[p], rtol=1e-4, atol=1e-5)
        # the proposer's own step 1 is that construction at the last position, fed its draft
        own_ids = torch.cat([ids[1:], torch.tensor(drafted[:1])])
        own_hidden = torch.cat([hidden, carried[-1:]])
        own_pos = torch.cat([pos, pos[-1:] + 1])
        own1, _ = propose.head(propose.decode(own_ids, own_hidden, own_pos)[-1])
        torch.testing.assert_close(seen[1], own1, rtol=1e-5, atol=1e-6)


def cli_args(case, out_dir, **settings):
    eval_settings = {
        "num_speculative_tokens": K,
        "max_new_tokens": 8,
        "num_prompts": 3,
        "device": "cpu",
        **settings,
    }
    return stage_args(
        "evaluate",
        **{k: case[k] for k in ("target", "draft", "vocab", "eval_set", "preflight")},
        out=out_dir / "eval.json",
        plot=out_dir / "eval.png",
        settings={"eval": eval_settings},
    )


def test_cli_writes_json_and_png(case, tmp_path):
    assert cli.main(cli_args(case, tmp_path)) == 0
    trained = Eagle3Proposer(load_draft(case["draft"]))
    report = json.loads((tmp_path / "eval.json").read_text())
    assert report["K"] == K and report["num_prompts"] == 3 and report["max_new_tokens"] == 8
    assert report["outputs_match_target_greedy"] is True
    reference = [greedy_generate(case["model"], p, 8, case["eos"]) for p in case["prompts"][:3]]
    assert report["output_tokens"] == sum(map(len, reference))
    for name in ("trained", "untrained"):
        m = report[name]
        assert m["num_draft_tokens"] == K * m["num_drafts"] > 0
        assert m["acceptance_length"] == pytest.approx(1 + m["accepted_tokens"] / m["num_drafts"])
        assert len(m["per_position_acceptance"]) == K
        assert sum(m["accepted_at_position"]) == m["accepted_tokens"]
        # per prompt, in sample_ids' order: the figures' parts (for a paired comparison)
        assert len(m["per_prompt"]) == len(report["sample_ids"]) == 3
        assert [sum(c) for c in zip(*m["per_prompt"])] == [m["num_drafts"], m["accepted_tokens"]]
    assert report["sample_ids"] == ["conv.jsonl:1", "conv.jsonl:2", "conv.jsonl:3"]
    assert report["engine"] == {"name": "hf", "dtype": "float32", "device": "cpu"}  # auto on CPU
    by_k = report["trained"]["acceptance_length_by_k"]
    assert len(by_k) == K and by_k[-1] == report["trained"]["acceptance_length"]
    for k, al in enumerate(by_k, 1):  # each K' decoded for real, as its own run would count
        stats = SpecStats(k)
        for p in case["prompts"][:3]:
            speculative_generate(case["model"], p, trained, Decoding(k, 8, case["eos"], AUX), stats)
        assert al == pytest.approx(stats.metrics()["acceptance_length"]) and 1 <= al <= 1 + k
    # intervals over the 3 prompts (eyrie.evaluate.interval), around the point figures
    for name in ("trained", "untrained"):
        low, high = report[name]["acceptance_length_ci95"]
        assert low <= report[name]["acceptance_length"] <= high
    ratio = report["trained_over_untrained"]
    assert ratio["ratio"] == pytest.approx(
        report["trained"]["acceptance_length"] / report["untrained"]["acceptance_length"]
    )
    assert ratio["ci95"][0] <= ratio["ratio"] <= ratio["ci95"][1] and ratio["prompts_for_3pct"] >= 3
    assert report["provenance"]["settings"]["eval"]["num_speculative_tokens"] == K
    assert (tmp_path / "eval.png").read_bytes()[:4] == b"\x89PNG"
    # no temporaries left (.last-good: the report kept for a failed rerun, eyrie.core.io)
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".") and p.name != LAST_GOOD]


def test_cli_mismatched_aux_ids_one_line_error(case, tmp_path, capsys):
    bad = json.loads(case["preflight"].read_text())
    bad["aux_layer_ids"] = [1, 3]
    preflight = tmp_path / "preflight.json"
    preflight.write_text(json.dumps(bad))
    argv = cli_args(case, tmp_path)
    argv[argv.index("--preflight") + 1] = str(preflight)
    assert cli.main(argv) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if "error:" in line]
    assert len(err) == 1 and "aux_layer_ids [1, 3]" in err[0] and "[1, 2, 3]" in err[0]
    assert not (tmp_path / "eval.json").exists()


def test_cli_output_mismatch_names_prompt(case, tmp_path, monkeypatch, capsys, caplog):
    real = ev_specdec.speculative_generate

    def broken(*args, **kwargs):  # a decoding bug: drops the last token
        return real(*args, **kwargs)[:-1]

    monkeypatch.setattr(ev, "speculative_generate", broken)
    assert cli.main(cli_args(case, tmp_path, num_prompts=1)) == 2
    err = capsys.readouterr().err
    assert "prompt conv.jsonl:1" in err and "trained draft" in err
    assert not (tmp_path / "eval.json").exists()
    assert "eval.dtype: float32" not in err  # float32: a difference is a bug, not rounding
    # in bfloat16 a difference may be a near tie's rounding: counted, reported, not fatal
    assert cli.main(cli_args(case, tmp_path, num_prompts=1, dtype="bfloat16")) == 0
    assert "in bfloat16 a near tie can round either way" in caplog.text
    report = json.loads((tmp_path / "eval.json").read_text())
    assert report["outputs_match_target_greedy"] is False
    assert report["outputs_differing_from_greedy"]["trained draft"] == ["conv.jsonl:1"]


def test_bfloat16_decodes_in_bfloat16(case, tmp_path):
    """eval.dtype: bfloat16 runs the target and both drafts in bfloat16 and says so."""
    assert cli.main(cli_args(case, tmp_path, num_prompts=1, dtype="bfloat16")) == 0
    report = json.loads((tmp_path / "eval.json").read_text())
    assert report["engine"] == {"name": "hf", "dtype": "bfloat16", "device": "cpu"}
    assert report["provenance"]["settings"]["eval"]["dtype"] == "bfloat16"
    model, _ = ev.load_target(case["target"], "cpu", "bfloat16")
    assert next(model.parameters()).dtype == torch.bfloat16


def test_mt_bench_questions_as_the_eval_set(case, tmp_path):
    """eval.prompts: a question.jsonl, made an eval set by `eyrie eval-prompts`, is what the
    evaluation decodes (its first turns, named by question id)."""
    questions = tmp_path / "question.jsonl"
    questions.write_text(
        "\n".join(
            json.dumps({"question_id": 100 + i, "category": "demo", "turns": [t, "and then?"]})
            for i, t in enumerate(TEXTS[:2])
        )
    )
    prompts = tmp_path / "prompts.parquet"
    argv = ["eval-prompts", "--target", str(case["target"]), "--questions", str(questions)]
    assert cli.main([*argv, "--out", str(prompts), "--settings", "{}"]) == 0
    argv = cli_args(case, tmp_path, num_prompts=2)
    argv[argv.index("--eval-set") + 1] = str(prompts)
    assert cli.main(argv) == 0
    report = json.loads((tmp_path / "eval.json").read_text())
    reference = [greedy_generate(case["model"], p, 8, case["eos"]) for p in case["prompts"][:2]]
    assert report["num_prompts"] == 2 and report["output_tokens"] == sum(map(len, reference))


def test_bad_settings_listed_together():
    with pytest.raises(ev_errors.EvaluateError, match="eval.device.*eval.num_speculative_tokens"):
        ev.EvalSettings.from_settings(
            {
                "eval": {
                    "num_speculative_tokens": 0,
                    "max_new_tokens": 4,
                    "num_prompts": 1,
                    "device": "tpu",
                }
            }
        )


# ------------------------------------------------------------------ sampling (eval.temperature)


@pytest.mark.slow
def test_speculative_sampling_emits_the_targets_distribution():
    """verify_sampled keeps the target's distribution whatever the draft's: over many draws of a
    draft token from q, the first token emitted (the draft's if accepted, else the residual's
    draw) is distributed as p, here with a q far from p and with a one-hot q on p's least
    likely token (a greedy draft's)."""
    g = torch.Generator().manual_seed(0)
    p = torch.tensor([[0.5, 0.2, 0.15, 0.1, 0.05]] * 2, dtype=torch.float64)
    for q0 in ([0.05, 0.05, 0.1, 0.3, 0.5], [0.0, 0.0, 0.0, 0.0, 1.0]):
        q = torch.tensor(q0, dtype=torch.float64)
        counts = torch.zeros(5)
        n = 20000
        for _ in range(n):
            x = int(torch.multinomial(q, 1, generator=g))
            accepted, extra = ev_specdec.verify_sampled(p, [q], [x], g)
            counts[x if accepted else extra] += 1
        assert torch.allclose(counts / n, p[0].float(), atol=0.015), (q0, counts / n)


def test_sampling_at_a_tiny_temperature_is_greedy_decoding(case):
    """speculative_sample's plumbing (the drafted tokens, the target's distributions after
    each, the aux states carried) is the greedy path's: near temperature 0 both distributions
    are one-hot, so the output is the target's greedy one and the draft's acceptance that of
    greedy speculative decoding."""
    model, eos = case["model"], case["eos"]
    trained = Eagle3Proposer(load_draft(case["draft"]))
    for prompt in case["prompts"][:2]:
        greedy, sampled = SpecStats(K), SpecStats(K)
        decoding = Decoding(K, 9, eos, AUX)
        want = speculative_generate(model, prompt, trained, decoding, stats=greedy)
        g = torch.Generator().manual_seed(1)
        got = ev_specdec.speculative_sample(model, prompt, trained, decoding, 1e-4, g, sampled)
        assert got == want == greedy_generate(model, prompt, 9, eos)
        assert sampled.metrics() == greedy.metrics()


@pytest.mark.slow
def test_cli_at_a_temperature_reports_sampled_decoding_too(case, tmp_path):
    """eval.temperature: 1 adds the figures of speculative sampling ("sampled"), the trained and
    the untrained draft's and at every K' <= K, from a seeded stream: a second run reports the
    same; the greedy figures stay what they were."""
    reports = []
    for n in range(2):
        out = tmp_path / str(n)
        out.mkdir()
        assert cli.main(cli_args(case, out, temperature=1.0)) == 0
        reports.append(json.loads((out / "eval.json").read_text()))
    greedy_dir = tmp_path / "greedy"
    greedy_dir.mkdir()
    assert cli.main(cli_args(case, greedy_dir)) == 0
    greedy = json.loads((greedy_dir / "eval.json").read_text())
    assert "sampled" not in greedy and greedy["trained"] == reports[0]["trained"]
    sampled = reports[0]["sampled"]
    assert sampled == reports[1]["sampled"] and sampled["temperature"] == 1.0
    for name in ("trained", "untrained"):
        m = sampled[name]
        assert m["num_draft_tokens"] == K * m["num_drafts"] > 0
        assert [sum(c) for c in zip(*m["per_prompt"])] == [m["num_drafts"], m["accepted_tokens"]]
    assert len(sampled["trained"]["acceptance_length_by_k"]) == K
    assert sampled["trained_over_untrained"]["ratio"] > 0
