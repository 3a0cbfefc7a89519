"""What a target-conditioned drafter trains on: one teacher-forced target pass per sequence gives both its soft
labels (top-k of p_target at every reply position, as :mod:`dflash2.train.labels`) and its hidden states at the
tapped layers at every position (what the drafter reads at inference, ``drafters/conditioning.py``).

Sequences: the target's regenerated responses (token shards of ``dflash2 train data``), interleaved round-robin
across the directories, the last ``heldout`` of each directory kept apart; and optionally held-out chat
prompts from ``data/eval/mt_bench`` (the LAST questions of the file: the bench reads the first ones) answered
greedily by the target here (measurement only, never trained on).

One file per sequence (``<kind>-<index>.safetensors``: ``tokens``, ``label_start``, ``topk_ids``, ``topk_probs``,
``rest``, and with tapped layers ``taps`` bf16 [N, T * Dt]), written atomically; a re-run skips the files present
(resumable). About 9 KB per token with 3 taps of a 1536-wide target: these stay under ``runs/``, never in git. No
layers (an unconditioned drafter's features: the soft labels alone) store no taps.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import torch
from safetensors import safe_open

from dflash2.atomic import save_tensors_atomic, write_text_atomic
from dflash2.models.decoder import Transformer
from dflash2.train.labels import LabelledText, topk_labels

FEATURES_MANIFEST = "features.json"


@dataclass(frozen=True)
class FeatureItem:
    name: str  # file stem, e.g. "chat-01270"; the kind before the dash names its held-out group
    ids: list[int]
    label_start: int  # first labelled position (the prompt's last id: it predicts the first reply token)
    heldout: bool


@torch.no_grad()
def sequence_features(target: Transformer, ids: list[int], label_start: int, layers: tuple[int, ...],
                      top_k: int = 16) -> LabelledText:
    """One target pass over ``ids``: soft labels at positions label_start .. N - 2, taps of ``layers`` at every
    position (none where ``layers`` is empty)."""
    tensor = torch.tensor(ids, dtype=torch.int64)
    last = target.config.num_layers - 1
    out = target(tensor[None].to(target.device), hidden_layers=(*layers, last), logits="none")
    taps = torch.cat([h[0] for h in out.hidden_states[:-1]], dim=-1).to(torch.bfloat16).cpu() if layers else None
    hidden = out.hidden_states[-1][0, label_start : len(ids) - 1]  # [R, Dt]
    topk_ids, topk_probs, rest = topk_labels(target, hidden, top_k)
    return LabelledText(tensor, label_start, 0, topk_ids.long(), topk_probs.float(), rest.float(), taps)


def write_features(path: Path, text: LabelledText) -> None:
    tensors = {"tokens": text.ids.to(torch.int32), "label_start": torch.tensor([text.label_start]),
               "topk_ids": text.topk_ids.to(torch.int32).contiguous(),
               "topk_probs": text.topk_probs.to(torch.float16).contiguous(),
               "rest": text.rest.to(torch.float16).contiguous()}
    if text.taps is not None:
        tensors["taps"] = text.taps.contiguous()  # [N, T * Dt]
    save_tensors_atomic(tensors, path)


def read_features(path: str | Path, taps: bool = True) -> LabelledText:
    """A feature file's sequence; with ``taps``, its taps too (a file written without tapped layers has none)."""
    with safe_open(str(path), framework="pt") as handle:
        if taps and "taps" not in handle.keys():
            raise ValueError(f"{path} holds no taps (its features were built without tapped layers)")
        get = handle.get_tensor
        return LabelledText(get("tokens").long(), int(get("label_start")[0]), 0, get("topk_ids").long(),
                            get("topk_probs").float(), get("rest").float(), get("taps") if taps else None)


def regenerated_items(data_dirs: str, heldout: int, limit: int | None = None) -> list[FeatureItem]:
    """Training items interleaved across ``data_dirs`` (round-robin, at most ``limit`` in all), then the last
    ``heldout`` sequences of each directory (held out). Kind = the directory's name after the target's."""
    from dflash2.train.data import TokenShards

    parts = [(d, TokenShards(d, load_hidden=False)) for d in data_dirs.split(",") if d]
    items: list[FeatureItem] = []
    columns = []
    for directory, shards in parts:
        kind = "chat" if Path(directory).name.endswith("-chat") else "code"
        train = range(max(len(shards) - heldout, 0))
        columns.append([(kind, i, shards) for i in train])
        items += [_item(kind, i, shards, True) for i in range(len(train), len(shards))]
    interleaved = [entry for row in zip(*columns) for entry in row]  # (the shortest directory sets the length)
    return [_item(kind, i, shards, False) for kind, i, shards in interleaved[:limit]] + items


def _item(kind: str, index: int, shards, heldout: bool) -> FeatureItem:
    sequence = shards[index]
    return FeatureItem(f"{kind}-{index:05d}", sequence.ids.tolist(), max(sequence.prompt_length - 1, 0), heldout)


def mt_bench_items(target: Transformer, tokenizer, count: int, max_new_tokens: int = 128,
                   out_dir: Path | None = None) -> Iterator[FeatureItem]:
    """The target's greedy answers to the last ``count`` MT-bench questions (first turn; held out)."""
    from dflash2.bench.datasets import load_suite
    from dflash2.train.data import chat_encoder, greedy_response

    prompts = load_suite("mt_bench")[-count:] if count else []
    encode = chat_encoder(tokenizer)
    for index, prompt in enumerate(prompts, start=len(load_suite("mt_bench")) - len(prompts)):
        name = f"mtbench-{index:05d}"
        if out_dir is not None and (out_dir / f"{name}.safetensors").exists():
            continue
        prompt_ids = encode(prompt.text)
        reply = greedy_response(target, prompt_ids, max_new_tokens, tokenizer.eos_token_ids)
        yield FeatureItem(name, prompt_ids + reply, len(prompt_ids) - 1, True)


def build_features(out_dir: str | Path, target: Transformer, items, layers: tuple[int, ...], top_k: int = 16,
                   target_model: str = "") -> Path:
    """Write the features of every item not yet on disk; the manifest lists training and held-out names. No
    ``layers``: no taps, except in a directory begun with taps, whose new files get the same taps (one kind of file
    a directory)."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    manifest_path = out_dir / FEATURES_MANIFEST
    manifest = json.loads(manifest_path.read_text()) if manifest_path.exists() else {
        "target_layers": list(layers), "target_hidden_size": target.config.hidden_size, "top_k": top_k,
        "target_model": target_model, "train": [], "heldout": []}
    layers = tuple(layers) or tuple(manifest["target_layers"])
    if tuple(manifest["target_layers"]) != layers:
        held = f"taps of layers {manifest['target_layers']}" if manifest["target_layers"] else "no taps"
        raise ValueError(f"{out_dir} holds {held}, not of layers {list(layers)}")
    started = time.perf_counter()
    for item in items:
        path = out_dir / f"{item.name}.safetensors"
        if not path.exists():
            write_features(path, sequence_features(target, item.ids, item.label_start, layers, top_k))
        group = manifest["heldout" if item.heldout else "train"]
        if item.name not in group:
            group.append(item.name)
            write_text_atomic(manifest_path, json.dumps(manifest, indent=1) + "\n")
        print(f"{item.name}: {len(item.ids)} ids ({time.perf_counter() - started:.0f} s)", flush=True)
    return out_dir


class FeatureSet:
    """The sequences of a features directory: ``train`` and ``heldout`` names from its manifest (files present)."""

    def __init__(self, directory: str | Path) -> None:
        self.directory = Path(directory)
        self.manifest = json.loads((self.directory / FEATURES_MANIFEST).read_text())
        present = {p.stem for p in self.directory.glob("*.safetensors")}
        self.train = [n for n in self.manifest["train"] if n in present]
        self.heldout = [n for n in self.manifest["heldout"] if n in present]

    @property
    def target_layers(self) -> tuple[int, ...]:
        return tuple(self.manifest["target_layers"])

    @property
    def target_hidden_size(self) -> int:
        return int(self.manifest["target_hidden_size"])

    def read(self, name: str, taps: bool = True) -> LabelledText:
        return read_features(self.directory / f"{name}.safetensors", taps)

    def heldout_groups(self) -> dict[str, list[str]]:
        """Held-out names by kind ("code", "chat", "mtbench")."""
        groups: dict[str, list[str]] = {}
        for name in self.heldout:
            groups.setdefault(name.split("-")[0], []).append(name)
        return groups
