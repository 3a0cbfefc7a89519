"""Your prompts, your drafter: distil the shipped drafter further on a user's own prompt file.

``dflash2 train distil --prompts FILE.jsonl --out DIR``: each line is ``{"prompt": "..."}`` or ``{"messages":
[{"role": ..., "content": ...}, ...]}`` (a chat; the target answers its last user turn). The target answers every
prompt greedily (its own text: what it will be asked to verify), one teacher-forced pass per answer gives the
features (soft labels, and only when conditioned the taps it reads, :mod:`dflash2.train.target_features`), the last
``heldout_share`` of the prompts are held out, and a run starts from the shipped drafter. The held-out tau before
(step 0: the shipped drafter) and after is the report; ``DIR/run/drafter`` is the result.

How it trains follows what measured best on the default target (docs/pard.md, "Every context position"): an
adapter without conditioning, with the loss's gradient through the context pass too (the exact gradient) at a
gentle learning rate; loadable with ``--drafter pard+ngram --draft-model DIR/run/drafter``. A start that is
conditioned on the target (or ``condition=True``) trains its conditioning as well and loads with ``--drafter
dflash2``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable

from dflash2.models.decoder import Transformer
from dflash2.train.target_features import FeatureItem, build_features

Encoder = Callable[[list[dict]], list[int]]  # chat messages -> prompt ids (the chat template applied)


@dataclass(frozen=True)
class DistilReport:
    drafter_dir: Path
    before: dict  # held-out set -> {"tau", "blocks", "acceptance_by_position"} at step 0
    after: dict  # the same at the end
    conditioned: bool  # the result is conditioned on the target (loads with --drafter dflash2)
    conditioned_start: bool  # the adapter it started from was (then so is the result)

    def lines(self) -> list[str]:
        out = []
        for name, first in self.before.items():
            last = self.after.get(name, first)
            out.append(f"held-out {name} ({first['blocks']} blocks): tau {first['tau']:.3f} -> {last['tau']:.3f}; "
                       "acceptance by position "
                       + " ".join(f"{a:.2f}->{b:.2f}" for a, b in zip(first["acceptance_by_position"],
                                                                      last["acceptance_by_position"])))
        return out


def read_prompt_file(path: str | Path) -> list[list[dict]]:
    """Each JSONL line as chat messages: ``prompt`` -> one user turn; ``messages`` as given (ending in a user turn)."""
    chats = []
    for number, line in enumerate(Path(path).read_text(encoding="utf-8").splitlines(), start=1):
        if not line.strip():
            continue
        row = json.loads(line)
        if "messages" in row:
            messages = list(row["messages"])
        elif "prompt" in row:
            messages = [{"role": "user", "content": row["prompt"]}]
        else:
            raise ValueError(f"{path}:{number}: a line needs 'prompt' or 'messages'")
        if not messages or messages[-1].get("role") != "user":
            raise ValueError(f"{path}:{number}: the last message must be the user's (the target answers it)")
        chats.append(messages)
    return chats


def prompt_items(target: Transformer, chats: list[list[dict]], encode: Encoder, stop_ids: Iterable[int],
                 heldout_share: float, max_new_tokens: int, features_dir: Path) -> Iterable[FeatureItem]:
    """The target's greedy answer to each chat as a feature item, the last ``heldout_share`` held out (at least
    one, and at least one for training); items already on disk are skipped without answering again."""
    from dflash2.train.data import greedy_response

    if len(chats) < 2:
        raise ValueError("need at least 2 prompts: one to train on, one to measure the gain on")
    held = min(max(1, round(len(chats) * heldout_share)), len(chats) - 1)
    for index, messages in enumerate(chats):
        heldout = index >= len(chats) - held
        name = f"{'heldout' if heldout else 'user'}-{index:05d}"
        if (features_dir / f"{name}.safetensors").exists():
            yield FeatureItem(name, [], 0, heldout)  # (build_features skips the pass for a file on disk)
            continue
        prompt_ids = encode(messages)
        reply = greedy_response(target, prompt_ids, max_new_tokens, stop_ids)
        yield FeatureItem(name, prompt_ids + reply, len(prompt_ids) - 1, heldout)


def distil(target: Transformer, chats: list[list[dict]], encode: Encoder, stop_ids: Iterable[int], out_dir: str | Path,
           *, base_dir: str, init_adapter: str, layers: tuple[int, ...], steps: int = 100,
           heldout_share: float = 0.2, max_new_tokens: int = 256, threads: int | None = None,
           condition: bool | None = None, **overrides) -> DistilReport:
    """Answer, featurise, train (resumable: re-run the same call), report (see the module docstring).
    ``condition``: train a target-conditioned drafter (None: when the start is one)."""
    from dflash2.drafters.conditioning import TargetConditioning, has_conditioning
    from dflash2.drafters.pard import PardConfig
    from dflash2.train.pard_trainer import PardTrainConfig, train_pard

    out_dir = Path(out_dir)
    features = out_dir / "features"
    context = False
    conditioned_start = has_conditioning(init_adapter)
    if condition is False and conditioned_start:
        raise ValueError(f"{init_adapter} is conditioned on the target: it cannot train without its conditioning")
    condition = conditioned_start if condition is None else condition
    if conditioned_start:  # the shipped drafter's own taps, and where it reads them
        shipped_conditioning = TargetConditioning.load(init_adapter).config
        layers, context = shipped_conditioning.target_layers, shipped_conditioning.context
    build_features(features, target, prompt_items(target, chats, encode, stop_ids, heldout_share, max_new_tokens,
                                                  features), layers if condition else ())  # (taps: conditioning only)
    shipped = PardConfig.load(init_adapter)
    settings = dict(base_dir=base_dir, label_dirs="", out_dir=str(out_dir / "run"), features_dir=str(features),
                    base_model=shipped.base_model, target_model=shipped.target_model,
                    num_draft_tokens=shipped.num_draft_tokens, lora_rank=shipped.lora_rank,
                    lora_alpha=shipped.lora_alpha, mask_token_id=shipped.mask_token_id, init_adapter=str(init_adapter),
                    condition=condition, condition_context=context, exact_gradient=not condition,
                    num_steps=steps, eval_every=0, learning_rate=1e-4 if condition else 5e-5, mask_learning_rate=2e-4,
                    warmup_steps=min(10, max(steps // 10, 1)), anchors_per_sequence=32, sequences_per_step=2,
                    eval_anchors=16, checkpoint_every=10, threads=threads)
    drafter_dir = train_pard(PardTrainConfig(**{**settings, **overrides}))
    evals = [json.loads(line) for line in (out_dir / "run" / "eval.jsonl").read_text().splitlines()]
    before = next(e for e in evals if e["step"] == 0)
    after = evals[-1]
    return DistilReport(drafter_dir, {k: v for k, v in before.items() if k != "step"},
                        {k: v for k, v in after.items() if k != "step"}, condition, conditioned_start)
