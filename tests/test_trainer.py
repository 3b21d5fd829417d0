"""The shared trainer: schedule, accumulation, data order, logging, hooks, NaN handling, OOM message."""

from __future__ import annotations

import json
import math

import pytest
import torch
from torch import nn

from components.config_shared import ComputeParams, TrainParams
from components.training import checkpoint as ckpt
from components.training.batches import MicroBatches, StepSampler, micro_batch_size
from components.training.optim import LrGroup, lr_at, param_groups
from components.training.trainer import NonFiniteLossError, Trainer
from tests.scripts.tiny_train import TinyLM, fixed_mask_collate, make_rows, random_mask_collate

CPU = ComputeParams(device="cpu", seed=1234, precision="fp32")  # exact-equality tests: no autocast


def tp(**kw) -> TrainParams:
    base = dict(batch_size=8, lr=3e-3, max_steps=6, warmup_ratio=0.2, checkpoint_every=100, keep_checkpoints=2)
    return TrainParams(**{**base, **kw})


def make_trainer(tmp_path, model=None, collate=fixed_mask_collate, rows=None, **kw):
    log = kw.pop("log", None)
    hooks = kw.pop("hooks", None)
    log_every = kw.pop("log_every", 1)
    torch.manual_seed(0)
    model = model if model is not None else TinyLM(dropout=0.0)
    return Trainer(model, rows or make_rows(), collate, tp(**kw), CPU, tmp_path, log_fn=log, hooks=hooks,
                   log_every=log_every, progress=False)  # fmt: skip


class NaNAt(nn.Module):
    """Wraps a model; its loss is NaN on the given 1-based forward calls, or from `from_call` on."""

    def __init__(self, inner: nn.Module, calls=(), from_call: int | None = None):
        super().__init__()
        self.inner, self.bad, self.from_call, self.calls = inner, set(calls), from_call, 0

    def forward(self, batch):
        out = self.inner(batch)
        self.calls += 1
        if self.calls in self.bad or (self.from_call is not None and self.calls >= self.from_call):
            out["loss"] = out["loss"] * float("nan")
        return out


def params_of(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


# ----------------------------------------------------------------------------------------------
def test_lr_schedule_warmup_then_linear_decay():
    t = TrainParams(lr=1e-3, max_steps=10, warmup_ratio=0.2)  # warmup: 2 steps
    lrs = [lr_at(s, t) for s in range(10)]
    assert lrs[0] == pytest.approx(0.5e-3) and lrs[1] == pytest.approx(1e-3)
    assert lrs[2] == pytest.approx(1e-3)  # peak, then linear decay
    assert all(a > b for a, b in zip(lrs[2:], lrs[3:]))
    assert lrs[9] == pytest.approx(1e-3 / 8) and lrs[9] > 0  # no step is wasted at lr 0
    assert lr_at(0, TrainParams(lr=1e-3, max_steps=4, warmup_ratio=0.0)) == pytest.approx(1e-3)


def test_batch_size_must_divide_by_world_and_accum(tmp_path):
    assert micro_batch_size(tp(batch_size=16, grad_accum=2), world_size=2) == 4
    with pytest.raises(ValueError, match=r"train\.batch_size=10.*grad_accum \(3\)"):
        make_trainer(tmp_path, batch_size=10, grad_accum=3)
    with pytest.raises(ValueError, match=r"retromae\.train\.batch_size=6"):
        micro_batch_size(tp(batch_size=6, grad_accum=4), 1, phase="retromae.train")
    # a phase that borrows its grad_accum (the reader warm-up: realm.train's) names the keys a user sets
    with pytest.raises(ValueError, match=r"^realm\.reader_warmup_batch_size=6 .* realm\.train\.grad_accum \(4\)"):
        micro_batch_size(tp(batch_size=6, grad_accum=4), 1, phase="realm.reader_warmup")


def test_no_weight_decay_on_bias_and_layernorm_tied_listed_once():
    model = TinyLM()
    decay, no_decay = param_groups(model, 0.01)
    ids = lambda ps: {id(p) for p in ps}  # noqa: E731
    assert id(model.emb.weight) in ids(decay["params"]) and id(model.head.bias) in ids(no_decay["params"])
    assert id(model.norm.weight) in ids(no_decay["params"]) and id(model.norm.bias) in ids(no_decay["params"])
    assert no_decay["weight_decay"] == 0.0
    all_params = decay["params"] + no_decay["params"]
    assert len(all_params) == len(ids(all_params)) == len(list(model.parameters()))  # tie counted once


def test_grad_accumulation_equals_full_batch(tmp_path):
    full = make_trainer(tmp_path / "a", batch_size=8, grad_accum=1)
    accum = make_trainer(tmp_path / "b", batch_size=8, grad_accum=2)  # 2 micro-batches of 4
    assert accum.micro_batch == 4
    full.fit(), accum.fit()
    pa, pb = params_of(full.raw_model), params_of(accum.raw_model)
    start = params_of(TinyLM(dropout=0.0))  # guard: training moved the weights at all
    assert max((pa[k] - start[k]).abs().max() for k in pa) > 1e-3
    for k in pa:
        torch.testing.assert_close(pa[k], pb[k], atol=1e-6, rtol=0)


def test_data_order_is_an_epoch_permutation_sharded_by_rank():
    one = StepSampler(40, batch_size=8, world_size=1, rank=0, grad_accum=1, seed=5)
    ranks = [StepSampler(40, 8, world_size=2, rank=r, grad_accum=2, seed=5) for r in (0, 1)]
    for step in range(5):  # one epoch: every row once
        split = [i for s in ranks for m in range(2) for i in s.indices(step, m)]
        assert split == one.indices(step, 0)
    epoch0 = [i for step in range(5) for i in one.indices(step, 0)]
    assert sorted(epoch0) == list(range(40))
    epoch1 = [i for step in range(5, 10) for i in one.indices(step, 0)]
    assert sorted(epoch1) == list(range(40)) and epoch1 != epoch0
    assert StepSampler(40, 8, 1, 0, 1, seed=6).indices(0, 0) != one.indices(0, 0)


def test_collate_generator_is_per_step_and_reproducible():
    rows = make_rows(32)
    sampler = StepSampler(32, 8, 1, 0, 2, seed=3)
    a = MicroBatches(rows, random_mask_collate, sampler, start_step=0, max_steps=4, seed=3)
    b = MicroBatches(rows, random_mask_collate, sampler, start_step=2, max_steps=4, seed=3)  # "resumed" at 2
    assert a.with_generator and len(a) == 8 and len(b) == 4
    for i in range(4):
        torch.testing.assert_close(a[4 + i]["labels"], b[i]["labels"])
    assert not torch.equal(a[0]["labels"], a[2]["labels"])  # different steps, different masks

    def hf_style(rows, return_tensors=None):  # a second positional arg is NOT a generator
        assert return_tensors is None
        return fixed_mask_collate(rows)

    assert not MicroBatches(rows, hf_style, sampler, 0, 1, 3).with_generator
    MicroBatches(rows, hf_style, sampler, 0, 1, 3)[0]


def test_logging_metrics_and_log_every(tmp_path):
    logged: list[tuple[int, dict]] = []
    losses: list[float] = []

    class Recording(TinyLM):
        def forward(self, batch):
            out = super().forward(batch)
            losses.append(out["loss"].item())
            return out

    torch.manual_seed(0)
    t = make_trainer(tmp_path, model=Recording(dropout=0.0), max_steps=5, grad_accum=2, log_every=2,
                     log=lambda m, s: logged.append((s, m)))  # fmt: skip
    result = t.fit()
    assert [s for s, _ in logged] == [2, 4, 5]  # every 2 steps, and the final step
    m = logged[0][1]
    assert {"loss", "acc", "grad_norm", "lr", "tokens_per_s", "samples_per_s", "bad_steps"} <= set(m)
    assert "num_tokens" not in m
    # steps 1-2 = forward calls 0..3; logged loss = their mean (accumulation and window averaged)
    assert m["loss"] == pytest.approx(sum(losses[:4]) / 4, rel=1e-6)
    assert logged[-1][1]["loss"] == pytest.approx(sum(losses[8:10]) / 2, rel=1e-6)
    assert m["lr"] == pytest.approx(lr_at(1, t.train))
    assert result.metrics == logged[-1][1] and result.step == 5 and result.bad_steps == 0


def test_hooks_are_called(tmp_path):
    calls = []
    hooks = {
        "on_train_start": lambda step, tr: calls.append(("start", step)),
        "on_step_end": lambda step, tr: calls.append(("step", step, tr.step)),
        "on_checkpoint": lambda step, path: calls.append(("ckpt", step, path.name, path.is_dir())),
    }
    make_trainer(tmp_path, max_steps=4, checkpoint_every=2, hooks=hooks).fit()
    assert calls == [
        ("start", 0), ("step", 1, 1), ("ckpt", 2, "step-000002", True), ("step", 2, 2),
        ("step", 3, 3), ("ckpt", 4, "step-000004", True), ("step", 4, 4),
    ]  # fmt: skip
    with pytest.raises(ValueError, match="unknown hook"):
        make_trainer(tmp_path, hooks={"on_step_begin": print})


def test_nan_steps_are_skipped_and_counted(tmp_path):
    torch.manual_seed(0)
    model = NaNAt(TinyLM(dropout=0.0), calls={3, 5})
    snaps: dict[int, dict] = {}
    logged = {}
    t = make_trainer(tmp_path, model=model, max_steps=7, max_bad_steps=2,
                     hooks={"on_step_end": lambda s, tr: snaps.__setitem__(s, params_of(tr.raw_model))},
                     log=lambda m, s: logged.__setitem__(s, m))  # fmt: skip
    result = t.fit()
    assert result.step == 7 and result.bad_steps == 2
    for bad in (3, 5):  # no update on a skipped step
        assert all(torch.equal(snaps[bad][k], snaps[bad - 1][k]) for k in snaps[bad])
    assert any(not torch.equal(snaps[4][k], snaps[3][k]) for k in snaps[4])  # good steps do update
    assert "loss" not in logged[3] and logged[3]["bad_steps"] == 1.0
    assert all(math.isfinite(v) for m in logged.values() for v in m.values())
    assert all(math.isfinite(v.abs().max()) for v in snaps[7].values())


def test_consecutive_nan_stops_and_keeps_last_good_checkpoint(tmp_path):
    torch.manual_seed(0)
    model = NaNAt(TinyLM(dropout=0.0), from_call=7)  # steps 7.. are bad
    t = make_trainer(tmp_path, model=model, max_steps=20, checkpoint_every=5, max_bad_steps=3)
    with pytest.raises(NonFiniteLossError, match=r"3 consecutive.*max_bad_steps=3.*step-000005"):
        t.fit()
    root = tmp_path / "checkpoints"
    assert [s for s, _ in ckpt.list_checkpoints(root)] == [5]
    ckpt.verify_checkpoint(root / "step-000005")
    assert not list(root.glob(".tmp-*"))
    # the last good weights are usable
    fresh = NaNAt(TinyLM(dropout=0.0))
    ckpt.load_model_weights(root / "step-000005", fresh)
    assert all(torch.isfinite(p).all() for p in fresh.parameters())


def test_cuda_oom_is_reraised_with_advice(tmp_path):
    class OOM(TinyLM):
        def forward(self, batch):
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    t = make_trainer(tmp_path, model=OOM(), grad_accum=2)
    with pytest.raises(torch.OutOfMemoryError) as e:
        t.fit()
    msg = str(e.value)
    for hint in ("train.grad_accum", "train.batch_size", "max_len", "compute.precision", "Tried to allocate"):
        assert hint in msg
    # a phase that borrows its knobs (the reader warm-up) names the keys a user sets
    warmup = Trainer(OOM(), make_rows(), fixed_mask_collate, tp(grad_accum=2), CPU, tmp_path / "warmup", progress=False,
                     param_prefix="realm.reader_warmup")
    with pytest.raises(torch.OutOfMemoryError, match=r"raise realm\.train\.grad_accum \(same global batch\) or lower "
                                                     r"realm\.reader_warmup_batch_size;"):
        warmup.fit()


def test_hf_dataset_rows_match_a_list():
    datasets = pytest.importorskip("datasets")
    rows = make_rows(32)
    sampler = StepSampler(32, 8, 1, 0, 1, seed=3)
    from_list = MicroBatches(rows, random_mask_collate, sampler, 0, 3, seed=3)
    from_hf = MicroBatches(datasets.Dataset.from_list(rows), random_mask_collate, sampler, 0, 3, seed=3)
    for i in range(3):
        for k in ("input_ids", "labels"):
            assert torch.equal(from_list[i][k], from_hf[i][k])


def test_dataloader_workers_give_the_same_training(tmp_path):
    a = make_trainer(tmp_path / "a", collate=random_mask_collate, max_steps=3)
    b = make_trainer(tmp_path / "b", collate=random_mask_collate, max_steps=3, num_workers=1)
    a.fit(), b.fit()
    pa, pb = params_of(a.raw_model), params_of(b.raw_model)
    assert all(torch.equal(pa[k], pb[k]) for k in pa)


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_mixed_precision_trains_and_resumes(tmp_path, precision):
    compute = ComputeParams(device="cpu", precision=precision)
    train = tp(max_steps=4, checkpoint_every=2)
    torch.manual_seed(0)
    t = Trainer(TinyLM(dropout=0.0), make_rows(), fixed_mask_collate, train, compute, tmp_path, progress=False)
    assert t.precision == precision and t.scaler.is_enabled() == (precision == "fp16")
    result = t.fit()
    assert result.step == 4 and math.isfinite(result.metrics["loss"])
    state = ckpt.load_state(tmp_path / "checkpoints" / "step-000004")
    assert bool(state["scaler"]) == (precision == "fp16")  # GradScaler state saved when used
    again = Trainer(TinyLM(dropout=0.0), make_rows(), fixed_mask_collate, train, compute, tmp_path, progress=False)
    assert again.fit().resumed_from == 4
    if precision == "fp16":
        assert again.scaler.get_scale() == t.scaler.get_scale()


def test_a_finished_run_resumed_returns_its_weights_metrics_and_rng(tmp_path):
    """What a shared phase relies on (`shared_phase`): a second Trainer on the same folder trains
    nothing, and leaves the model, the final metrics and the RNG where the first run left them."""
    first = make_trainer(tmp_path, model=TinyLM(dropout=0.1), max_steps=4, checkpoint_every=2)
    done = first.fit()
    after_first = torch.rand(3)  # the RNG stream right after a trained phase

    second = make_trainer(tmp_path, model=TinyLM(dropout=0.1), max_steps=4, checkpoint_every=2)
    again = second.fit()
    assert again.resumed_from == 4 and again.step == 4
    # the summary of the run that trained (all but the machine's own measurements of that window)
    assert again.metrics == {k: v for k, v in done.metrics.items() if k not in ("samples_per_s", "tokens_per_s", "rss_mb")}
    assert {"loss", "acc", "grad_norm", "lr"} <= set(again.metrics)
    trained, resumed = params_of(first.raw_model), params_of(second.raw_model)
    assert all(torch.equal(trained[k], resumed[k]) for k in trained)
    assert second.raw_model.training  # in train mode, as a run that trained leaves it
    assert again.curve == done.curve and len(done.curve) == 4  # the whole loss curve, not just the steps since the resume
    assert torch.equal(torch.rand(3), after_first)  # what follows the phase draws the same numbers


# ----------------------------------------------------------------------------------------------
# per-group learning rates (warm_start.head_lr: a fresh head beside a pre-trained body)
# ----------------------------------------------------------------------------------------------
def _in_head(name: str) -> bool:
    return name.startswith(("block.", "head."))  # head.weight is tied to emb.weight: body


def _lr_trace(trainer: Trainer) -> list[dict[tuple[str, float], float]]:
    """After each step: {(group, weight_decay): lr} of every optimiser group."""
    seen: list = []
    trainer.hooks.on_step_end.append(lambda step, t: seen.append(
        {(g["group"], g["weight_decay"]): g["lr"] for g in t.optimizer.param_groups}))
    return seen


def test_lr_groups_keep_their_lr_through_the_schedule_and_the_decay_split(tmp_path):
    t = make_trainer(tmp_path, lr=1e-3)
    t = Trainer(t.raw_model, make_rows(), fixed_mask_collate, t.train, CPU, tmp_path, progress=False,
                lr_groups=[LrGroup("head", _in_head, 5e-3)])
    groups = {(g["group"], g["weight_decay"]): g for g in t.optimizer.param_groups}
    ids = lambda ps: {id(p) for p in ps}  # noqa: E731
    m = t.raw_model
    assert id(m.block.linear1.weight) in ids(groups[("head", 0.01)]["params"])
    assert id(m.block.norm1.weight) in ids(groups[("head", 0.0)]["params"])  # no decay on LayerNorm, head or not
    assert id(m.head.bias) in ids(groups[("head", 0.0)]["params"])
    assert id(m.emb.weight) in ids(groups[("", 0.01)]["params"]) and id(m.norm.weight) in ids(groups[("", 0.0)]["params"])
    everything = [p for g in groups.values() for p in g["params"]]
    assert len(everything) == len(ids(everything)) == len(list(m.parameters()))
    trace = _lr_trace(t)
    t.fit()
    for step, lrs in enumerate(trace):
        base = lr_at(step, t.train)
        assert lrs[("", 0.01)] == lrs[("", 0.0)] == base
        assert lrs[("head", 0.01)] == lrs[("head", 0.0)] == pytest.approx(5 * base)
    assert t.last_metrics["lr_head"] == pytest.approx(5 * t.last_metrics["lr"])


def test_no_lr_groups_is_the_one_lr_trainer(tmp_path):
    plain, grouped = make_trainer(tmp_path / "a"), make_trainer(tmp_path / "b")
    grouped = Trainer(grouped.raw_model, make_rows(), fixed_mask_collate, grouped.train, CPU, tmp_path / "b",
                      progress=False, lr_groups=[LrGroup("head", _in_head, grouped.train.lr)])
    plain.fit(), grouped.fit()
    pa, pb = params_of(plain.raw_model), params_of(grouped.raw_model)
    for k in pa:  # scale 1: the same updates (group order differs, so only to float tolerance)
        torch.testing.assert_close(pa[k], pb[k], atol=1e-6, rtol=0)


def test_lr_groups_survive_a_resume(tmp_path):
    def trainer(out):
        t = make_trainer(out, lr=1e-3, checkpoint_every=3)
        return Trainer(t.raw_model, make_rows(), fixed_mask_collate, t.train, CPU, out, progress=False,
                       lr_groups=[LrGroup("head", _in_head, 4e-3)])

    whole = trainer(tmp_path / "whole")
    whole_trace = _lr_trace(whole)
    whole.fit()

    class Stop(Exception):
        pass

    first = trainer(tmp_path / "cut")
    first.hooks.on_step_end.append(lambda step, t: (_ for _ in ()).throw(Stop()) if step == 3 else None)
    with pytest.raises(Stop):
        first.fit()
    again = trainer(tmp_path / "cut")
    trace = _lr_trace(again)
    assert again.fit().resumed_from == 3
    assert trace == whole_trace[3:]
    assert {g["group"]: g["lr_scale"] for g in again.optimizer.param_groups} == {"": 1.0, "head": pytest.approx(4.0)}
    pa, pb = params_of(whole.raw_model), params_of(again.raw_model)
    for k in pa:
        torch.testing.assert_close(pa[k], pb[k], atol=1e-6, rtol=0)


def test_constant_schedule_warms_up_then_holds():
    t = TrainParams(lr=1e-3, max_steps=10, warmup_ratio=0.2)
    assert [lr_at(s, t, "constant") for s in range(10)] == [5e-4] + [1e-3] * 9


def test_autocast_for_follows_compute_precision_outside_the_trainer():
    """Embedding and evaluation run in compute.precision: bf16 autocasts matmuls on the CPU, fp32
    and CPU `auto` leave them alone."""
    from components.training.precision import autocast_for

    x, w = torch.randn(4, 8), torch.randn(8, 3)
    with autocast_for("bf16", "cpu"):
        assert (x @ w).dtype == torch.bfloat16
    for precision in ("fp32", "auto"):
        with autocast_for(precision, torch.device("cpu")):
            assert (x @ w).dtype == torch.float32


def test_bf16_if_native_follows_the_cpu(monkeypatch, caplog):
    """`bf16_if_native` autocasts on a CPU with native BF16 and stays fp32 on one that would emulate
    it; explicit `bf16` on an emulating CPU still runs bf16 but warns, naming the param."""
    from components.training import precision as T

    cpu = torch.device("cpu")
    x, w = torch.randn(4, 8), torch.randn(8, 3)
    for native, want in ((True, torch.bfloat16), (False, torch.float32)):
        monkeypatch.setattr(T, "cpu_has_native_bf16", lambda native=native: native)
        assert T.resolve_precision("bf16_if_native", cpu) == ("bf16" if native else "fp32")
        with T.autocast_for("bf16_if_native", cpu):
            assert (x @ w).dtype == want
    T._warn_emulated_bf16.cache_clear()
    with caplog.at_level("WARNING", logger=T.__name__):
        assert T.resolve_precision("bf16", cpu) == "bf16"
    assert "compute.precision=bf16_if_faster" in caplog.text


def test_bf16_if_faster_follows_the_measured_speedup(monkeypatch, tmp_path):
    """`bf16_if_faster` runs bf16 on a CPU only where its bf16 matmuls measured >= BF16_MIN_SPEEDUP x
    fp32's; the measurement is made once per machine key and read back from $RR_PRECISION_CACHE after,
    a broken cache file is measured again, and a CPU without bf16 instructions is never measured."""
    from components.training import precision as T

    cpu = torch.device("cpu")
    cache = tmp_path / "cache" / "precision.json"
    monkeypatch.setenv(T.PRECISION_CACHE_ENV, str(cache))
    monkeypatch.setattr(T, "cpu_has_native_bf16", lambda: True)
    calls = []

    def measure_as(speedup):
        monkeypatch.setattr(T, "measure_cpu_bf16_speedup", lambda: calls.append(speedup) or speedup)
        T.cpu_bf16_speedup.cache_clear()

    measure_as(T.BF16_MIN_SPEEDUP + 0.5)
    assert T.resolve_precision("bf16_if_faster", cpu) == "bf16" and calls == [T.BF16_MIN_SPEEDUP + 0.5]
    measure_as(1.0)  # a new process on the same machine: the file answers, nothing is measured
    assert T.resolve_precision("bf16_if_faster", cpu) == "bf16" and len(calls) == 1
    assert json.loads(cache.read_text()) == {T._machine_key(): T.BF16_MIN_SPEEDUP + 0.5}

    cache.write_text("{not json")
    measure_as(1.0)
    with T.autocast_for("bf16_if_faster", cpu):
        assert (torch.randn(4, 8) @ torch.randn(8, 3)).dtype == torch.float32
    assert calls[-1] == 1.0 and json.loads(cache.read_text()) == {T._machine_key(): 1.0}

    monkeypatch.setattr(T, "cpu_has_native_bf16", lambda: False)
    measure_as(9.0)
    assert T.resolve_precision("bf16_if_faster", cpu) == "fp32" and calls[-1] == 1.0
    T.cpu_bf16_speedup.cache_clear()


def test_measure_cpu_bf16_speedup_times_both_precisions():
    """The measurement itself, at a toy shape: a positive, finite fp32 / bf16 time ratio."""
    from components.training.precision import measure_cpu_bf16_speedup

    ratio = measure_cpu_bf16_speedup(rounds=1, rows=32, width=16)
    assert math.isfinite(ratio) and ratio > 0


class _MaskedBert(nn.Module):
    """A tiny HF BertForMaskedLM as a Trainer model ({"loss"} from input_ids / labels), with dropout."""

    def __init__(self, attention_dropout: float, hidden_dropout: float = 0.0):
        super().__init__()
        from transformers import BertForMaskedLM

        from components.models.realm import tiny_bert_config

        cfg = tiny_bert_config(vocab_size=64, max_position=32)
        cfg.attention_probs_dropout_prob, cfg.hidden_dropout_prob = attention_dropout, hidden_dropout
        cfg._attn_implementation = "sdpa"
        self.mlm = BertForMaskedLM(cfg)

    def forward(self, batch: dict) -> dict:
        return {"loss": self.mlm(input_ids=batch["input_ids"], labels=batch["labels"]).loss}


def _attention_ps(model: nn.Module) -> list[float]:
    return [m.dropout.p for m in model.modules() if type(m).__name__.endswith("SelfAttention")]


def test_set_attention_dropout_sets_the_attention_layers_and_leaves_hidden_dropout():
    from components.models.encoder import set_attention_dropout

    model = _MaskedBert(attention_dropout=0.1, hidden_dropout=0.1)
    hidden = [m.p for n, m in model.named_modules() if isinstance(m, nn.Dropout) and not n.endswith("attention.self.dropout")]
    assert set_attention_dropout(model, 0.0) == 1 and _attention_ps(model) == [0.0]
    assert [m.p for n, m in model.named_modules() if isinstance(m, nn.Dropout) and not n.endswith("attention.self.dropout")] == hidden
    # the p SDPA reads in training is the one set: with no other dropout, a training-mode forward differs
    # from the eval-mode one before, and equals it after
    torch.manual_seed(0)
    model = _MaskedBert(attention_dropout=0.5)
    batch = {"input_ids": torch.randint(5, 64, (2, 12)), "labels": torch.randint(5, 64, (2, 12))}
    eval_loss = model.eval()(batch)["loss"]
    assert not torch.allclose(model.train()(batch)["loss"], eval_loss)
    set_attention_dropout(model, 0.0)
    torch.testing.assert_close(model.train()(batch)["loss"], eval_loss)


def test_set_attention_dropout_reaches_the_retromae_decoder():
    from components.models.encoder import set_attention_dropout

    layers = [type("DecoderLayer", (nn.Module,), {})() for _ in range(2)]
    for layer in layers:
        layer.attn_dropout = 0.1
    assert set_attention_dropout(nn.ModuleList(layers), 0.0) == 2 and [x.attn_dropout for x in layers] == [0.0, 0.0]


@pytest.mark.parametrize("attention_dropout", [None, 0.0, 0.2])
def test_compute_attention_dropout_is_what_the_trainer_trains_with(tmp_path, attention_dropout):
    model = _MaskedBert(attention_dropout=0.1)
    compute = ComputeParams(device="cpu", seed=1234, precision="fp32", attention_dropout=attention_dropout)
    rows = [{"input_ids": torch.randint(5, 64, (12,)).tolist()} for _ in range(16)]

    def collate(batch, generator=None):
        ids = torch.tensor([r["input_ids"] for r in batch])
        return {"input_ids": ids, "labels": ids.clone()}

    trainer = Trainer(model, rows, collate, tp(max_steps=1), compute, tmp_path, progress=False)
    assert _attention_ps(trainer.raw_model) == [0.1 if attention_dropout is None else attention_dropout]
    trainer.fit()
