"""Train a PARD drafter: LoRA adapters + a learned mask embedding on a pretrained small model, distilled from the
target's stored distributions (:mod:`dflash2.train.labels`; objective: :mod:`dflash2.train.pard_objective`).

The label directories may still be growing (a labelling run appends shards while training runs): each step
draws its sequences at random among those present, and a resumed run sees the new ones. Held out: every
``heldout_every``-th sequence (up to ``heldout_sequences`` of them), never trained on. AdamW on the adapter
and the mask embedding only, linear warmup then cosine; checkpoints (adapter, optimizer, step) let a stopped run
resume; ``drafter/`` holds the shippable result (``pard_config.json`` + ``adapter.safetensors``).
"""

from __future__ import annotations

import json
import re
import shutil
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from dflash2.atomic import save_tensors_atomic
from dflash2.drafters.lora import LORA_TARGETS, adapter_state, add_lora, load_adapter_state
from dflash2.drafters.pard import ADAPTER_FILE, PardConfig, default_mask_token_id, initial_mask_embedding
from dflash2.models.decoder import Transformer
from dflash2.train.dflash_trainer import (CHECKPOINTS, STATE_JSON, cosine_with_warmup, latest_checkpoint,
                                          load_optimizer_state, split_optimizer_state)
from dflash2.train.labels import HardLabels, LabelShards, LabelledText
from dflash2.train.pard_objective import build_pard_batch, heldout_acceptance, pard_loss, sample_blocks

FINAL_DRAFTER = "drafter"
STATE_TENSORS = "training_state.safetensors"


@dataclass(frozen=True)
class PardTrainConfig:
    """One PARD training run. Fields after ``seed`` may change between a run and its resumption."""

    base_dir: str  # HF-style directory of the drafter's base network (the store's 0.5B)
    label_dirs: str  # soft-label shard directories (dflash2 train labels), comma-separated; "" = none
    out_dir: str  # checkpoints/, drafter/, train_log.jsonl, eval.jsonl
    hard_label_dirs: str = ""  # token shard directories (dflash2 train data) whose next token is the label
    base_model: str = ""  # the base's store name, recorded in pard_config.json
    target_model: str = ""  # the target the labels came from
    num_draft_tokens: int = 8  # k: drafts per forward (k - 1 mask positions)
    lora_rank: int = 16
    lora_alpha: float = 32.0
    mask_token_id: int | None = None  # default: the last embedding row
    keep_ratio: float = 0.7  # conditional drop: probability that a block keeps its next mask row
    decay: float = 0.9  # row j weighs decay^j (times the probability the target reaches it)
    reach_weight: bool = True  # multiply by the target's probability of the real tokens before the row
    ce_weight: float = 0.1  # weight of the cross-entropy on the real next token (besides the distillation)
    max_sequence_length: int = 768  # longer sequences are truncated
    soft_share: float = 0.5  # share of training sequences drawn from the soft labels (when both kinds are given)
    heldout_every: int = 40  # soft labels: sequence i is held out when i % heldout_every == 0 ...
    heldout_sequences: int = 24  # ... for the first this many such i; hard labels: the last this many
    init_adapter: str = ""  # warm start: a shipped adapter directory (LoRA + mask embedding; fresh optimizer)
    features_dir: str = ""  # `dflash2 train features`: soft labels + target taps (replaces label_dirs / hard ones)
    train_sequences: int | None = None  # with features_dir: train on its first this many sequences only
    condition: bool = False  # read the target's taps (drafters/conditioning.py; needs features_dir)
    condition_context: bool = False  # ... at every context position too (ConditioningConfig.context)
    exact_gradient: bool = False  # the loss's gradient through the context pass too (implied by condition_context)
    condition_kv: bool = False  # read the target's taps through gated keys / values (drafters/kv_conditioning.py)
    gate_init: float = 0.0  # condition_kv: the gates' start (0 = closed: step 0 drafts as the adapter it starts from)
    seed: int = 0
    anchors_per_sequence: int = 32  # blocks per sequence per step
    sequences_per_step: int = 4  # gradient accumulation
    num_steps: int = 2000  # optimizer steps of the whole run (sets the cosine schedule)
    learning_rate: float = 2e-4
    mask_learning_rate: float = 2e-3  # the mask embedding starts far from anything trained: a faster rate
    conditioning_learning_rate: float = 5e-4  # the conditioning's projection (starts at zero)
    gate_learning_rate: float = 1e-2  # condition_kv: the per-layer gates (start closed, at 0)
    warmup_steps: int = 20
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    eval_every: int = 50  # held-out acceptance every this many steps (and at step 0 and the end)
    initial_eval: bool = True  # the untrained drafter's held-out acceptance at step 0 of a fresh run
    eval_anchors: int = 8  # blocks per held-out sequence
    checkpoint_every: int = 10
    keep_checkpoints: int = 2
    stop_at_step: int | None = None  # end this run after this step; a re-run resumes
    resume: bool = True
    save_dtype: str = "bf16"  # dtype of the shipped adapter (checkpoints keep fp32)
    threads: int | None = None
    progress: bool = True

    def recipe(self) -> dict:
        fields = asdict(self)
        added = {"features_dir": "", "train_sequences": None, "condition": False,  # absent from older recipes
                 "condition_context": False, "exact_gradient": False, "condition_kv": False, "gate_init": 0.0}
        return {key: fields[key] for key in list(fields)[: list(fields).index("seed") + 1]
                if key not in ("base_dir", "label_dirs", "hard_label_dirs", "out_dir", "features_dir")
                and not (key in added and fields[key] == added[key])}


class TrainingData:
    """The soft-label and hard-label sets, their held-out splits, and the draw of a training sequence."""

    def __init__(self, config: PardTrainConfig) -> None:
        self.features = None
        if config.features_dir:
            self._read_features(config)
            return
        if config.condition or config.condition_kv:
            raise ValueError("a conditioned drafter trains on `dflash2 train features` data: give features_dir")
        self.soft = LabelShards(config.label_dirs) if config.label_dirs else None
        self.hard = HardLabels(config.hard_label_dirs) if config.hard_label_dirs else None
        if self.soft is None and self.hard is None:
            raise ValueError("no training data: give label_dirs and/or hard_label_dirs")
        self.soft_share = config.soft_share if self.soft and self.hard else (1.0 if self.soft else 0.0)
        self.soft_train: list[int] = []
        self.heldout: dict[str, list[LabelledText]] = {}
        if self.soft is not None:
            # every heldout_every-th sequence of the sources other than regenerated shards (those are held out
            # below, through the hard-label split, whose held-out sequences the label stream reaches last)
            others = [i for i in range(len(self.soft)) if not self.soft.source_spec(i).startswith("regen:")]
            held = others[:: config.heldout_every][: config.heldout_sequences]
            self.soft_train = [i for i in range(len(self.soft)) if i not in set(held)]
            self.heldout["labels"] = [_truncate(self.soft[i], config.max_sequence_length) for i in held]
        self.hard_train: list[int] = []
        if self.hard is not None:
            self.hard_train, held = self.hard.split_heldout(config.heldout_sequences)
            self.heldout["regenerated"] = [_truncate(self.hard[i], config.max_sequence_length) for i in held]

    def _read_features(self, config: PardTrainConfig) -> None:
        from dflash2.train.target_features import FeatureSet

        self.features = FeatureSet(config.features_dir)
        self.taps = config.condition or config.condition_kv
        self.feature_train = self.features.train[: config.train_sequences]
        self.ordered = config.train_sequences  # None: random draws among all training sequences
        self.heldout = {kind: [_truncate(self.features.read(n, self.taps), config.max_sequence_length)
                               for n in names[: config.heldout_sequences]]  # (the first of each group)
                        for kind, names in self.features.heldout_groups().items()}

    def _ordered(self, position: int) -> LabelledText:
        from dflash2.train.target_features import FeatureSet

        while position >= len(self.feature_train):  # `dflash2 train features` is still writing it
            time.sleep(10)
            self.feature_train = FeatureSet(self.features.directory).train[: self.ordered]
        return self.features.read(self.feature_train[position], self.taps)

    def describe(self) -> str:
        if self.features is not None:
            held = ", ".join(f"{kind} {len(texts)}" for kind, texts in self.heldout.items())
            return f"features {len(self.feature_train)} sequences + held out {held}"
        parts = []
        if self.soft is not None:
            parts.append(f"soft labels {len(self.soft_train)} + {len(self.heldout['labels'])} held out")
        if self.hard is not None:
            parts.append(f"hard labels {len(self.hard_train)} + {len(self.heldout['regenerated'])} held out")
        return "; ".join(parts)

    def draw(self, generator: torch.Generator, index: int = 0) -> LabelledText:
        """A training sequence: at random; with ``train_sequences`` set, the ``index``-th draw of the run takes the
        features' sequences in order, each once per epoch (waiting for one still being written)."""
        if self.features is not None:
            if self.ordered is not None:
                return self._ordered(index % self.ordered)
            if not self.feature_train:
                raise ValueError(f"no training sequence in {self.features.directory} yet")
            pick = int(torch.randint(len(self.feature_train), (1,), generator=generator))
            return self.features.read(self.feature_train[pick], self.taps)
        soft = bool(torch.rand((1,), generator=generator) < self.soft_share) and bool(self.soft_train)
        pool, source = (self.soft_train, self.soft) if soft or not self.hard_train else (self.hard_train, self.hard)
        return source[pool[int(torch.randint(len(pool), (1,), generator=generator))]]


def _truncate(text: LabelledText, max_length: int) -> LabelledText:
    if len(text.ids) <= max_length:
        return text
    rows = max(0, max_length - 1 - text.label_start)
    return LabelledText(text.ids[:max_length], text.label_start, text.source, text.topk_ids[:rows],
                        text.topk_probs[:rows], text.rest[:rows],
                        None if text.taps is None else text.taps[:max_length])


def build_model(config: PardTrainConfig) -> tuple[Transformer, int, list[torch.nn.Parameter], torch.nn.Parameter]:
    """The fp32 base with LoRA adapters; (model, mask id, adapter params, mask embedding parameter)."""
    from dflash2.models.loading import load_transformer

    model = load_transformer(config.base_dir, "fp32", packed=False)
    mask_id = config.mask_token_id if config.mask_token_id is not None else \
        default_mask_token_id(model.config.vocab_size)
    params = add_lora(model, config.lora_rank, config.lora_alpha, LORA_TARGETS)
    mask_embedding = torch.nn.Parameter(initial_mask_embedding(model, used_ids=mask_id))
    model.embed = MaskedEmbedding(model.embed, mask_id, mask_embedding)
    return model, mask_id, params, mask_embedding


class MaskedEmbedding(torch.nn.Module):
    """The frozen embedding table with the row of ``mask_id`` replaced by a trainable vector."""

    def __init__(self, base: torch.nn.Embedding, mask_id: int, mask_embedding: torch.nn.Parameter) -> None:
        super().__init__()
        self.base = base
        self.mask_id = mask_id
        self.mask_embedding = mask_embedding  # [D]

    @property
    def weight(self) -> torch.Tensor:  # the decoder reads its device and dtype from here
        return self.base.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:  # [B, T] -> [B, T, D]
        out = self.base(ids)
        return torch.where((ids == self.mask_id)[..., None], self.mask_embedding.to(out.dtype), out)


def build_conditioning(config: PardTrainConfig, data: TrainingData, model: Transformer):
    """The target conditioning (fp32, trainable; drafting as without it at start), or None when the run does not
    condition."""
    if config.condition_context and not config.condition:
        raise ValueError("condition_context conditions every context position on the target: it needs condition")
    if config.condition_kv:
        if config.condition:
            raise ValueError("condition (input offsets) and condition_kv (gated keys / values) are two designs: "
                             "choose one")
        from dflash2.drafters.kv_conditioning import GatedKVConditioning, KVConditioningConfig

        return GatedKVConditioning(KVConditioningConfig(data.features.target_layers, data.features.target_hidden_size,
                                                        model.config.hidden_size, model.config.num_layers),
                                   seed=config.seed, gate_init=config.gate_init)
    if not config.condition:
        return None
    from dflash2.drafters.conditioning import ConditioningConfig, TargetConditioning

    return TargetConditioning(ConditioningConfig(data.features.target_layers, data.features.target_hidden_size,
                                                 model.config.hidden_size, context=config.condition_context))


def train_pard(config: PardTrainConfig) -> Path:
    """Run (or resume) training; returns the directory of the adapter written at the end."""
    from tqdm import tqdm

    if config.threads:
        torch.set_num_threads(config.threads)
    out_dir = Path(config.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    data = TrainingData(config)
    model, mask_id, lora_params, mask_embedding = build_model(config)
    conditioning = build_conditioning(config, data, model)
    groups = [{"params": lora_params, "lr": config.learning_rate},
              {"params": [mask_embedding], "lr": config.mask_learning_rate}]
    if config.condition_kv:  # the projection, and the gates at a rate of their own
        groups += [{"params": list(conditioning.fc.parameters()), "lr": config.conditioning_learning_rate},
                   {"params": [conditioning.gates], "lr": config.gate_learning_rate}]
    elif conditioning is not None:
        groups.append({"params": list(conditioning.parameters()), "lr": config.conditioning_learning_rate})
    optimizer = torch.optim.AdamW([g for g in groups if g["params"]], betas=(0.9, 0.95),
                                  weight_decay=config.weight_decay)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: cosine_with_warmup(
        step, config.warmup_steps, config.num_steps, 0.1))
    step = 0
    latest = latest_checkpoint(out_dir) if config.resume else None
    if latest is not None:
        step = _load_checkpoint(latest, config, model, mask_embedding, optimizer, scheduler, conditioning)
    elif config.init_adapter:
        _warm_start(Path(config.init_adapter), config, model, mask_embedding, mask_id)
        _warm_start_conditioning(Path(config.init_adapter), conditioning)
    heldout = data.heldout
    print(f"data: {data.describe()}" + (f"; resuming at step {step}" if step else ""), flush=True)
    end = min(config.num_steps, config.stop_at_step or config.num_steps)
    if latest is None and config.initial_eval:  # the untrained drafter's acceptance, once
        _report_eval(model, heldout, config, mask_id, 0, out_dir, conditioning=conditioning)
    bar = tqdm(total=config.num_steps, initial=step, desc="training pard", unit="step", disable=not config.progress,
               dynamic_ncols=True)
    model.train()
    interrupted = False
    try:
        while step < end:
            started = time.perf_counter()
            generator = torch.Generator().manual_seed(config.seed * 1_000_003 + step)
            optimizer.zero_grad(set_to_none=True)
            total_loss, total_rows, total_tokens = 0.0, 0, 0
            for index in range(step * config.sequences_per_step, (step + 1) * config.sequences_per_step):
                text = _truncate(data.draw(generator, index), config.max_sequence_length)
                anchors, depths = sample_blocks(text.label_start, text.topk_ids.shape[0], config.anchors_per_sequence,
                                                config.num_draft_tokens - 1, config.keep_ratio, generator)
                if len(anchors) == 0:
                    continue
                batch = build_pard_batch(text.label_start, text.ids, anchors, depths, mask_id)
                loss, rows = pard_loss(model, text, batch, decay=config.decay, ce_weight=config.ce_weight,
                                       reach=config.reach_weight, conditioning=conditioning,
                                       exact=config.exact_gradient)
                (loss / config.sequences_per_step).backward()
                total_loss += float(loss.detach()) / config.sequences_per_step
                total_rows += rows
                total_tokens += batch.context_length + len(batch.input_ids)
            params = lora_params + [mask_embedding] + ([] if conditioning is None else list(conditioning.parameters()))
            if config.grad_clip > 0:
                torch.nn.utils.clip_grad_norm_(params, config.grad_clip)
            lr = optimizer.param_groups[0]["lr"]
            optimizer.step()
            scheduler.step()
            step += 1
            seconds = time.perf_counter() - started
            bar.update(1)
            bar.set_postfix(loss=f"{total_loss:.3f}", rows=total_rows, tok_s=f"{total_tokens / seconds:.0f}")
            _append_jsonl(out_dir / "train_log.jsonl", {"step": step, "loss": round(total_loss, 5), "lr": lr,
                                                        "rows": total_rows, "tokens": total_tokens,
                                                        "seconds": round(seconds, 2)})
            if step % config.checkpoint_every == 0 or step == end:
                save_checkpoint(out_dir, model, mask_embedding, optimizer, scheduler, step, config, conditioning)
            if config.eval_every and step % config.eval_every == 0 and step != end:
                _report_eval(model, heldout, config, mask_id, step, out_dir, bar, conditioning)
    except KeyboardInterrupt:  # stop quickly: checkpoint and adapter, no held-out check (a re-run resumes)
        interrupted = True
        bar.write(f"interrupted at step {step}: checkpoint and adapter saved; a re-run resumes")
    finally:
        bar.close()
    save_checkpoint(out_dir, model, mask_embedding, optimizer, scheduler, step, config, conditioning)
    result = {} if interrupted else _report_eval(model, heldout, config, mask_id, step, out_dir,
                                                 conditioning=conditioning)
    return save_adapter(out_dir / FINAL_DRAFTER, model, mask_embedding, config, mask_id,
                        {"steps": step, "labels": config.label_dirs, "hard_labels": config.hard_label_dirs,
                         "features": config.features_dir, "heldout": result}, conditioning=conditioning)


def save_adapter(directory: Path, model: Transformer, mask_embedding: torch.Tensor, config: PardTrainConfig,
                 mask_id: int, record: dict | None = None, dtype: str | None = None, conditioning=None) -> Path:
    """``directory/{pard_config.json, adapter.safetensors}`` (what ships), and the conditioning's two files when
    the run conditions on the target."""
    from dflash2.models.loading import parse_dtype

    directory.mkdir(parents=True, exist_ok=True)
    state = adapter_state(model, mask_embedding, parse_dtype(dtype or config.save_dtype))
    save_file(state, str(directory / ADAPTER_FILE))
    PardConfig(base_model=config.base_model or config.base_dir, mask_token_id=mask_id,
               num_draft_tokens=config.num_draft_tokens, lora_rank=config.lora_rank, lora_alpha=config.lora_alpha,
               lora_targets=LORA_TARGETS, target_model=config.target_model, extra=record or {}).save(directory)
    if conditioning is not None:
        conditioning.save(directory, parse_dtype(dtype or config.save_dtype))
    return directory


def adapter_from_checkpoint(run_dir: str | Path, out_dir: str | Path, step: int | None = None,
                            dtype: str = "bf16", default_num_draft_tokens: int | None = None) -> Path:
    """``out_dir/{pard_config.json, adapter.safetensors}`` from a checkpoint of a run (the latest, or ``step``),
    without stopping the run; the record names the step, the checkpoint and that step's held-out numbers
    (``eval.jsonl``) when it was evaluated. ``default_num_draft_tokens``: the draft length users get (measured
    fastest with `dflash2 bench`; at most the trained one)."""
    from dflash2.models.config import ModelConfig
    from dflash2.models.loading import parse_dtype
    from dflash2.models.store import resolve_model

    run_dir = Path(run_dir)
    path = latest_checkpoint(run_dir) if step is None else run_dir / CHECKPOINTS / f"step_{step:07d}"
    if path is None or not (path / STATE_JSON).exists():
        raise FileNotFoundError(f"no checkpoint {'' if step is None else step} in {run_dir}")
    state = json.loads((path / STATE_JSON).read_text())
    recipe, step = state["recipe"], int(state["step"])
    if default_num_draft_tokens is not None and not 1 <= default_num_draft_tokens <= recipe["num_draft_tokens"]:
        raise ValueError(f"the default draft length must lie in 1..{recipe['num_draft_tokens']} (the trained one); "
                         f"got {default_num_draft_tokens}")
    with safe_open(str(path / STATE_TENSORS), framework="pt") as handle:
        adapter = {name.removeprefix("adapter."): handle.get_tensor(name).to(parse_dtype(dtype)).contiguous()
                   for name in handle.keys() if name.startswith("adapter.")}
    mask_id = recipe["mask_token_id"]
    if mask_id is None:
        base = resolve_model(recipe["base_model"], "bf16", pull=False)
        mask_id = default_mask_token_id(ModelConfig.from_dir(base).vocab_size)
    evals = [json.loads(line) for line in (run_dir / "eval.jsonl").read_text().splitlines()] \
        if (run_dir / "eval.jsonl").exists() else []
    heldout = next((e for e in reversed(evals) if e["step"] == step), None)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    save_file(adapter, str(out_dir / ADAPTER_FILE))
    PardConfig(base_model=recipe["base_model"], mask_token_id=mask_id, num_draft_tokens=recipe["num_draft_tokens"],
               default_num_draft_tokens=default_num_draft_tokens, lora_rank=recipe["lora_rank"], lora_alpha=recipe["lora_alpha"], lora_targets=LORA_TARGETS,
               target_model=recipe["target_model"],
               extra={"steps": step, "checkpoint": str(path), "recipe": recipe,
                      "heldout": {k: v for k, v in heldout.items() if k != "step"} if heldout else None}
               ).save(out_dir)
    if "conditioning" in state:  # a run conditioned on the target: its conditioning ships beside the adapter
        conditioning = conditioning_from_record(state["conditioning"])
        with safe_open(str(path / STATE_TENSORS), framework="pt") as handle:
            conditioning.load_state_dict({name.removeprefix("conditioning."): handle.get_tensor(name)
                                          for name in handle.keys() if name.startswith("conditioning.")})
        conditioning.save(out_dir, parse_dtype(dtype))
    return out_dir


def write_draft_vocab(adapter_dir: str | Path, token_dirs: str, size: int, heldout_sequences: int = 16) -> Path:
    """``adapter_dir/draft_vocab.safetensors``: the ``size`` ids most frequent in the target's own responses (the
    regenerated token shards ``token_dirs``, comma-separated, without their held-out sequences; ties toward the
    smaller id, i.e. the earlier BPE merge), so the drafter's head computes only those rows (``load_pard_model``)."""
    from dflash2.drafters.pard import DRAFT_VOCAB_FILE, PardConfig
    from dflash2.train.data import ShardSet, frequent_ids

    shards = ShardSet([d for d in token_dirs.split(",") if d], load_hidden=False)
    train, _ = shards.split_heldout(heldout_sequences)
    ids = frequent_ids(shards, train, size)
    mask_id = PardConfig.load(adapter_dir).mask_token_id
    if bool((ids == mask_id).any()):
        raise ValueError(f"draft vocabulary of {size} ids would contain the mask token {mask_id}")
    path = Path(adapter_dir) / DRAFT_VOCAB_FILE
    save_tensors_atomic({"draft_vocab": ids.to(torch.int32).contiguous()}, path,
                        metadata={"source": token_dirs, "sequences": str(len(train))})  # (the same bytes each time)
    return path


def _report_eval(model, heldout: dict[str, list[LabelledText]], config: PardTrainConfig, mask_id: int, step: int,
                 out_dir: Path, bar=None, conditioning=None) -> dict:
    """Held-out tau and acceptance by position per held-out set, printed and appended to eval.jsonl."""
    results = {}
    for name, texts in heldout.items():
        tau, by_position, blocks = heldout_acceptance(model, texts, config.num_draft_tokens, mask_id,
                                                      config.eval_anchors, conditioning)
        line = (f"step {step}: held-out {name} tau {tau:.3f} over {blocks} blocks; acceptance by position "
                + " ".join(f"{p:.2f}" for p in by_position))
        if bar is None:
            print(line, flush=True)
        else:
            bar.write(line)
        results[name] = {"tau": round(tau, 4), "blocks": blocks,
                         "acceptance_by_position": [round(p, 4) for p in by_position]}
    _append_jsonl(out_dir / "eval.jsonl", {"step": step, **results})
    return results


def _append_jsonl(path: Path, record: dict) -> None:
    with open(path, "a", encoding="utf-8") as handle:
        handle.write(json.dumps(record) + "\n")


# ---- checkpoints -----------------------------------------------------------------------------------------


def save_checkpoint(out_dir: Path, model, mask_embedding, optimizer, scheduler, step: int,
                    config: PardTrainConfig, conditioning=None) -> Path:
    """``checkpoints/step_N`` (atomic: temp dir + rename); older ones pruned."""
    root = Path(out_dir) / CHECKPOINTS
    root.mkdir(parents=True, exist_ok=True)
    destination = root / f"step_{step:07d}"
    if destination.exists():
        return destination
    tmp = Path(tempfile.mkdtemp(prefix=".step.tmp-", dir=root))
    try:
        tensors = {f"adapter.{k}": v for k, v in adapter_state(model, mask_embedding, torch.float32).items()}
        if conditioning is not None:
            tensors.update({f"conditioning.{name}": tensor.detach().float().contiguous()
                            for name, tensor in conditioning.state_dict().items()})
        optimizer_state = optimizer.state_dict()
        scalars = split_optimizer_state(optimizer_state, tensors)
        save_file(tensors, str(tmp / STATE_TENSORS))
        state = {"step": step, "recipe": config.recipe(), "optimizer_param_groups": optimizer_state["param_groups"],
                 "optimizer_scalars": scalars, "scheduler": scheduler.state_dict()}
        if conditioning is not None:
            state["conditioning"] = conditioning_record(conditioning)
        (tmp / STATE_JSON).write_text(json.dumps(state, indent=1) + "\n")
        tmp.rename(destination)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    checkpoints = sorted(p for p in root.glob("step_*") if re.fullmatch(r"step_\d+", p.name))
    for old in checkpoints[: max(0, len(checkpoints) - max(1, config.keep_checkpoints))]:
        shutil.rmtree(old, ignore_errors=True)
    return destination


def _warm_start(adapter_dir: Path, config: PardTrainConfig, model, mask_embedding, mask_id: int) -> None:
    """Start from a shipped adapter's LoRA weights and mask embedding (the optimizer starts fresh). The run's rank
    may be higher than the adapter's (more capacity) when ``alpha / rank`` is the same: the adapter fills the
    leading rank, the added B columns start at zero, so step 0 drafts exactly as the adapter does."""
    shipped = PardConfig.load(adapter_dir)
    expected = {"lora_scale": config.lora_alpha / config.lora_rank, "mask_token_id": mask_id,
                "lora_targets": list(LORA_TARGETS)}
    found = {"lora_scale": shipped.lora_alpha / shipped.lora_rank, "mask_token_id": shipped.mask_token_id,
             "lora_targets": list(shipped.lora_targets)}
    mismatched = {name: (found[name], want) for name, want in expected.items() if found[name] != want}
    if shipped.lora_rank > config.lora_rank:
        mismatched["lora_rank"] = (shipped.lora_rank, config.lora_rank)
    if mismatched:
        raise ValueError(f"{adapter_dir} cannot start this run: (adapter, run) differ in {mismatched} (the run's "
                         "lora_rank may exceed the adapter's, with the same lora_alpha / lora_rank)")
    with safe_open(str(adapter_dir / ADAPTER_FILE), framework="pt") as handle:
        adapter = {name: handle.get_tensor(name).float() for name in handle.keys()}
    load_adapter_state(model, adapter, grow=True)
    mask_embedding.data.copy_(adapter["mask_embedding"])
    grown = f", rank {shipped.lora_rank} -> {config.lora_rank}" if config.lora_rank > shipped.lora_rank else ""
    print(f"warm start from {adapter_dir} ({shipped.extra.get('steps', '?')} steps{grown})", flush=True)


def conditioning_record(conditioning) -> dict:
    """The checkpoint's record of a conditioning's kind and config (``conditioning_from_record`` reads it)."""
    from dflash2.drafters.conditioning import config_record
    from dflash2.drafters.kv_conditioning import GatedKVConditioning

    record = config_record(conditioning.config)
    return {**record, "kind": "kv"} if isinstance(conditioning, GatedKVConditioning) else record


def conditioning_from_record(record: dict):
    from dflash2.drafters.conditioning import ConditioningConfig, TargetConditioning, config_from_record
    from dflash2.drafters.kv_conditioning import GatedKVConditioning, KVConditioningConfig

    fields = dict(record)
    if fields.pop("kind", None) == "kv":
        return GatedKVConditioning(config_from_record(KVConditioningConfig, fields))
    return TargetConditioning(config_from_record(ConditioningConfig, fields))


def _warm_start_conditioning(adapter_dir: Path, conditioning) -> None:
    """A conditioned run from an adapter conditioned the same way starts from its conditioning too."""
    from dflash2.drafters.conditioning import TargetConditioning, has_conditioning
    from dflash2.drafters.kv_conditioning import GatedKVConditioning, has_kv_conditioning

    if conditioning is None:
        return
    if isinstance(conditioning, GatedKVConditioning):
        shipped = GatedKVConditioning.load(adapter_dir) if has_kv_conditioning(adapter_dir) else None
    else:
        shipped = TargetConditioning.load(adapter_dir) if has_conditioning(adapter_dir) else None
    if shipped is None:
        return
    if shipped.config != conditioning.config:
        raise ValueError(f"{adapter_dir} conditions on {shipped.config}, this run on {conditioning.config}")
    conditioning.load_state_dict(shipped.state_dict())


def _load_checkpoint(path: Path, config: PardTrainConfig, model, mask_embedding, optimizer, scheduler,
                     conditioning=None) -> int:
    state = json.loads((path / STATE_JSON).read_text())
    if state["recipe"] != json.loads(json.dumps(config.recipe())):
        raise ValueError(f"{path} was written by a different training recipe; use another out_dir or --no-resume")
    with safe_open(str(path / STATE_TENSORS), framework="pt") as handle:
        tensors = {name: handle.get_tensor(name) for name in handle.keys()}
    adapter = {name.removeprefix("adapter."): t for name, t in tensors.items() if name.startswith("adapter.")}
    load_adapter_state(model, adapter)
    mask_embedding.data.copy_(adapter["mask_embedding"])
    if conditioning is not None:
        conditioning.load_state_dict({name.removeprefix("conditioning."): t for name, t in tensors.items()
                                      if name.startswith("conditioning.")})
    load_optimizer_state(optimizer, state, tensors)
    scheduler.load_state_dict(state["scheduler"])
    return int(state["step"])


__all__ = ["PardTrainConfig", "latest_checkpoint", "save_adapter", "save_checkpoint", "train_pard", "write_draft_vocab",
           "adapter_from_checkpoint"]
