"""``underlay demo`` end to end (2 gloo processes on CPU) and its pieces: prompts, reward, tokenizer, loss."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from underlay import cli
from underlay.checkpoint import latest
from underlay.data.arithmetic import FORMAT_REWARD, make_problems, reward
from underlay.demo.config import DemoConfig
from underlay.demo.grpo import PolicyLoss
from underlay.demo.tokenizer import build_tokenizer
from underlay.interfaces import ConfigError, InvalidInput, LossContext, TokenBatch, TokenOutputs
from underlay.tracking import read_jsonl


def test_demo_rejects_bad_arguments(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    assert cli.main(["demo", "--steps", "1", "--out-dir", str(tmp_path)]) == 2
    assert "--steps=1" in capsys.readouterr().err
    argv = ["demo", "--world-size", "2", "--prompts-per-step", "3", "--out-dir", str(tmp_path)]
    assert cli.main(argv) == 2
    assert "multiple of 2" in capsys.readouterr().err
    with pytest.raises(ConfigError, match="responses-per-prompt"):
        DemoConfig(responses_per_prompt=1)


def test_problems_are_deterministic_and_correct() -> None:
    probs = make_problems(50, seed=3)
    assert probs == make_problems(50, seed=3) and probs != make_problems(50, seed=4)
    for p in probs:
        a, op, b = p.prompt.removeprefix("What is ").removesuffix("?")
        value = {"+": int(a) + int(b), "-": int(a) - int(b), "*": int(a) * int(b)}[op]
        assert int(p.answer) == value >= 0
    with pytest.raises(InvalidInput):
        make_problems(-1, seed=0)


def test_reward_rules() -> None:
    assert reward("7", "7") == 1.0 and reward(" 7.", "7") == 1.0 and reward("7?x", "7") == 1.0
    assert reward("8", "7") == FORMAT_REWARD and reward(" 12 ", "7") == FORMAT_REWARD
    assert reward("is", "7") == 0.0 and reward("", "7") == 0.0 and reward("a8", "7") == 0.0


def test_tokenizer_roundtrip_and_specials(tmp_path: Path) -> None:
    tok = build_tokenizer()
    assert (tok.pad_token_id, tok.bos_token_id, tok.eos_token_id) == (0, 1, 2)
    text = "What is 9*8?"
    ids = tok(text)["input_ids"]
    assert ids[0] == tok.bos_token_id and len(ids) == len(text) + 1
    assert tok.decode(ids, skip_special_tokens=True) == text
    batch = tok(["What is 1+1?", "What is 12?"], padding=True, return_tensors="pt")
    assert batch["attention_mask"][1, 0] == 0  # left padding for generation
    tok.save_pretrained(str(tmp_path))
    from transformers import AutoTokenizer

    assert AutoTokenizer.from_pretrained(str(tmp_path))(text)["input_ids"] == ids


def test_policy_loss_matches_float64_reference() -> None:
    gen = torch.Generator().manual_seed(7)
    b, s, eps = 4, 9, 0.2
    logp = -torch.rand(b, s, generator=gen, dtype=torch.float64) * 3
    old = logp + (torch.rand(b, s, generator=gen, dtype=torch.float64) - 0.5) * 0.8
    adv = torch.randn(b, generator=gen, dtype=torch.float64)
    mask = (torch.rand(b, s, generator=gen) > 0.3).long()
    ent = torch.rand(b, s, generator=gen, dtype=torch.float64)
    ids = torch.randint(4, 20, (b, s), generator=gen)
    batch = TokenBatch(
        ids, torch.ones_like(ids), mask, {"advantages": adv.float(), "old_log_probs": old.float()}
    )
    lp32 = logp.float().requires_grad_(True)
    loss, metrics = PolicyLoss(eps)(TokenOutputs(lp32, ent.float()), batch, LossContext.single(mask))

    ratio = torch.exp(logp - old)
    ref_tok = torch.maximum(-adv[:, None] * ratio, -adv[:, None] * ratio.clamp(1 - eps, 1 + eps))
    m = mask.double()
    n = m.sum()
    assert torch.allclose(loss.double(), (ref_tok * m).sum() / n, rtol=1e-5, atol=1e-6)
    assert torch.allclose(
        torch.as_tensor(metrics["approx_kl"]).double(), ((old - logp) * m).sum() / n, atol=1e-5
    )
    assert torch.allclose(torch.as_tensor(metrics["entropy"]).double(), (ent * m).sum() / n, atol=1e-5)
    loss.backward()
    # gradient: -A * ratio where the unclipped branch is active, 0 where clipping binds
    active = (-adv[:, None] * ratio >= -adv[:, None] * ratio.clamp(1 - eps, 1 + eps)).double()
    ref_grad = -adv[:, None] * ratio * active * m / n
    assert lp32.grad is not None
    assert torch.allclose(lp32.grad.double(), ref_grad, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("with_tqdm", [True, False])
def test_progress_bar_and_console_lines(
    with_tqdm: bool, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import sys

    from underlay.demo.grpo import _Progress

    if not with_tqdm:
        monkeypatch.setitem(sys.modules, "tqdm", None)  # import now fails: plain text fallback
    bar = _Progress(total=2, enabled=True)
    if bar.stream is not None:
        bar.stream.write("step 0 | loss 0.5\npartial")
        bar.stream.write(" line\n")
    bar.update("reward 0.25")
    bar.update("done")
    bar.close()
    cap = capsys.readouterr()
    if with_tqdm:
        assert "step 0 | loss 0.5\npartial line\n" in cap.out
        assert "2/2" in cap.err and "done" in cap.err
    else:
        assert bar.stream is None and "[1/2] reward 0.25" in cap.err and "[2/2] done" in cap.err
    silent = _Progress(total=1, enabled=False)
    silent.update("x")
    silent.close()
    assert capsys.readouterr().err == ""


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.timeout(400)
def test_demo_default_run_end_to_end(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """One default run (2 gloo ranks, echo task from a jsonl file, locally trained BPE tokenizer) serves
    every end-to-end property: it at least doubles the mean reward between its first and last steps,
    writes metrics, TensorBoard events and a trace, redoes its last step identically after a checkpoint
    reload, and its HF export reloads with transformers. Its first rendezvous port is one another
    process already listens on (the race of a port found free and taken before rank 0 listens): the
    launcher retries with a new port. (One run instead of a short run plus this one: the process start,
    export and profiler dominate a run's cost; the flags are covered by
    test_demo_flags_reach_the_config.)"""
    import socket

    from underlay.parallel import distributed

    taken = socket.socket()
    taken.bind(("", 0))  # every interface: whatever address the rendezvous binds conflicts
    taken.listen()
    given: list[int] = []
    real_free_port = distributed.free_port

    def first_taken() -> int:
        given.append(int(taken.getsockname()[1]) if not given else real_free_port())
        return given[-1]

    monkeypatch.setattr(distributed, "free_port", first_taken)
    out = tmp_path / "out"
    try:
        assert cli.main(["demo", "--out-dir", str(out), "--no-progress"]) == 0
    finally:
        taken.close()
    assert len(given) == 2, given  # the taken port, then one retry
    printed = capsys.readouterr().out
    assert "learning: mean reward" in printed and "-> identical" in printed
    assert "tokenizer round trip ok" in printed
    summary = json.loads((out / "summary.json").read_text())
    assert summary["config"] == DemoConfig(out_dir=str(out), progress=False).to_dict()
    learn = summary["learning"]
    assert learn["window"] == 5 and learn["reward_last"] >= 2 * learn["reward_first"] > 0, learn
    assert Path(summary["data"]["path"]).is_file() and summary["data"]["vocab_size"] < 100

    rows = read_jsonl(out / "demo" / "metrics.jsonl")
    assert [r["step"] for r in rows] == list(range(DemoConfig().steps))
    for r in rows:
        for key in ("loss", "reward/mean", "grad_norm", "tokens_per_s", "timing/gen", "timing/update"):
            assert isinstance(r[key], float), (key, r)
        assert 0.0 <= r["reward/mean"] <= 1.0 and r["grad_norm"] >= 0 and r["tokens"] > 0
    assert any(r["grad_norm"] > 0 for r in rows)
    assert list((out / "demo" / "tensorboard").glob("events.out.tfevents.*"))

    assert summary["world_size"] == 2 and summary["engine"] == "fsdp2"
    # resume: the last step redone after reloading the checkpoint taken before it gives the same numbers
    res = summary["resume"]
    assert res["identical"] and res["same_prompts"] and res["step"] == len(rows) - 1
    assert res["loss"] == res["loss_after_reload"] == rows[-1]["loss"]
    assert res["grad_norm"] == res["grad_norm_after_reload"] == rows[-1]["grad_norm"]
    assert latest(out / "checkpoints") == Path(res["checkpoint"])  # complete (marker written)
    # export: reloaded with transformers, logits equal to the rollout copy synced from the engine
    exp = summary["export"]
    assert exp["max_abs_logit_diff"] <= 1e-5 and exp["max_abs_logprob_diff_vs_engine"] <= 1e-4
    assert (Path(exp["path"]) / "config.json").exists() and (Path(exp["path"]) / "tokenizer.json").exists()
    # profiler: one chrome trace of the profiled step (step 1 by default), with the demo's ranges
    (trace,) = summary["traces"]
    events = json.loads(Path(trace).read_text())["traceEvents"]
    names = {e.get("name") for e in events}
    assert {"gen", "update", "sync"} <= names


class _Launched(Exception):
    """Raised by the stand-in launcher of test_demo_flags_reach_the_config with what it was given."""


def test_demo_flags_reach_the_config(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Every ``underlay demo`` flag sets its DemoConfig field (the launcher is replaced by one that only
    records its arguments: the run itself is test_demo_default_run_end_to_end's)."""
    import underlay.demo

    def record(cfg: DemoConfig, launcher: str) -> dict[str, object]:
        raise _Launched(cfg, launcher)

    monkeypatch.setattr(underlay.demo, "run_demo", record)
    argv = ["demo", "--steps", "3", "--model-size", "small", "--out-dir", str(tmp_path), "--seed", "5"]
    argv += ["--world-size", "4", "--prompts-per-step", "4", "--responses-per-prompt", "3"]
    argv += ["--max-new-tokens", "6", "--lr", "0.5", "--launcher", "ray", "--no-progress"]
    with pytest.raises(_Launched) as got:
        cli.main(argv)
    cfg, launcher = got.value.args
    assert launcher == "ray"
    assert cfg == DemoConfig(
        steps=3,
        model_size="small",
        out_dir=str(tmp_path),
        seed=5,
        world_size=4,
        prompts_per_step=4,
        responses_per_prompt=3,
        max_new_tokens=6,
        lr=0.5,
        progress=False,
    )
