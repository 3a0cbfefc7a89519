"""Soft labels for drafter distillation: the target's next-token distribution at every position of existing text.

One teacher-forced target pass (a prefill, no generation) over a sequence gives ``p_target(. | ids[:p + 1])`` at
every position p at once, many times cheaper per token than regenerating responses on a CPU. The distribution is
stored compactly: its top-k ids and probabilities (temperature 1) and the mass ``rest`` left outside them.

Text comes from a deterministic stream of *items* (:func:`label_items`), interleaved round-robin over sources:

- ``regen:<dir>``: the sequences of a token-shard directory written by ``dflash2 train data`` (the target's own
  regenerated responses; labels from the first response position on);
- ``gsm8k:<path>``: GSM8K train solutions as a chat (question as the user turn, the worked solution with its
  calculator annotations ``<<...>>`` removed and ``#### N`` rewritten as ``The answer is N.`` as the reply);
- ``stdlib[:<dir>]``: the Python standard library's own sources (default: this interpreter's), cut into chunks
  of whole lines, each a chat whose reply is the chunk in a ```python fence.

Only the reply positions are labelled (``label_start`` = the last prompt position, whose distribution is the
first reply token's). On disk (``out_dir``)::

    manifest.json              settings, the shard list, items_done (position in the item stream), seconds
    labels_00000.safetensors
        tokens        [total] int32    the sequences concatenated
        offsets       [n + 1] int64    sequence i is tokens[offsets[i] : offsets[i + 1]]
        label_starts  [n] int32        first labelled position of sequence i
        row_offsets   [n + 1] int64    label rows of sequence i are rows[row_offsets[i] : row_offsets[i + 1]]
        sources       [n] int32        index of the item's source in manifest["settings"]["sources"]
        topk_ids      [rows, K] int32  row r of sequence i is position label_starts[i] + r - row_offsets[i]:
        topk_probs    [rows, K] fp16   the target's K likeliest next ids there and their probabilities,
        rest          [rows] fp16      and 1 - their sum (computed in fp32)

Shards and the manifest are written atomically; a killed run loses at most the items since the last shard, and a
re-run with the same settings skips ``items_done`` items of the stream and appends new shards.
"""

from __future__ import annotations

import bisect
import itertools
import json
import re
import sysconfig
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Iterator, Sequence

import torch
from safetensors import safe_open

from dflash2.atomic import save_tensors_atomic
from dflash2.models.decoder import Transformer
from dflash2.train.data import MANIFEST, TokenShards, _write_manifest, read_manifest  # one manifest format

MANIFEST_VERSION = 1
LABEL_SOURCE_KINDS = ("regen", "gsm8k", "stdlib")
# Standard-library directories left out of the code source: tests, IDLE, vendored packages, generated tables.
STDLIB_SKIP = ("test", "tests", "idlelib", "lib2to3", "ensurepip", "site-packages", "dist-packages", "__pycache__",
               "turtledemo", "pydoc_data", "encodings", "tkinter", "config-")


@dataclass(frozen=True)
class LabelItem:
    """One sequence to label."""

    source: int  # index of its source in the configured list
    ids: list[int]  # prompt + reply
    label_start: int  # first labelled position (its distribution is that of ids[label_start + 1])


@dataclass(frozen=True)
class LabelConfig:
    """What :func:`generate_labels` writes. Only ``max_items`` and ``shard_tokens`` may change on a re-run."""

    out_dir: str
    sources: tuple[str, ...]  # "regen:<dir>", "gsm8k:<path>", "stdlib" or "stdlib:<dir>", interleaved round-robin
    target_model: str = ""  # recorded; a re-run for another target is refused
    top_k: int = 16  # ids and probabilities stored per position
    max_tokens: int = 1024  # longer sequences are cut to this many ids
    chunk_tokens: int = 384  # code chunk size (stdlib), in tokens
    logit_rows: int = 128  # positions whose logits are computed at once (memory: rows x vocab x 4 bytes)
    max_items: int | None = None  # stop after this many items in total (None: the whole stream)
    shard_tokens: int = 16384  # write a shard once this many ids were labelled (a kill loses at most these)
    progress: bool = True


def _settings(config: LabelConfig) -> dict:
    settings = asdict(config)
    for volatile in ("out_dir", "max_items", "shard_tokens", "progress", "logit_rows"):
        settings.pop(volatile)
    settings["sources"] = list(config.sources)
    return settings


# ---- the item stream -------------------------------------------------------------------------------------


def label_items(sources: Sequence[str], tokenizer, *, max_tokens: int = 1024, chunk_tokens: int = 384
                ) -> Iterator[LabelItem]:
    """The configured sources interleaved round-robin (an exhausted source drops out); the same on every run."""
    streams = [(index, _source_items(spec, tokenizer, chunk_tokens)) for index, spec in enumerate(sources)]
    while streams:
        alive = []
        for index, stream in streams:
            item = next(stream, None)
            if item is None:
                continue
            alive.append((index, stream))
            ids, label_start = item
            ids = ids[:max_tokens]
            if label_start < len(ids) - 1:
                yield LabelItem(index, ids, label_start)
        streams = alive


def _source_items(spec: str, tokenizer, chunk_tokens: int) -> Iterator[tuple[list[int], int]]:
    kind, _, arg = spec.partition(":")
    if kind == "regen":
        for sequence in TokenShards(arg, load_hidden=False):
            yield sequence.ids.tolist(), max(sequence.prompt_length - 1, 0)
    elif kind == "gsm8k":
        if not arg:
            raise ValueError("the gsm8k source needs a path: gsm8k:<train jsonl>")
        for question, answer in gsm8k_solutions(arg):
            yield chat_pair(tokenizer, question, answer)
    elif kind == "stdlib":
        for name, chunk in stdlib_chunks(tokenizer, arg or None, chunk_tokens):
            request = f"Show the source code of the Python standard library module `{name}`."
            yield chat_pair(tokenizer, request, f"```python\n{chunk}```")
    else:
        raise ValueError(f"unknown label source {spec!r}; kinds: {', '.join(LABEL_SOURCE_KINDS)}")


def chat_pair(tokenizer, user: str, reply: str) -> tuple[list[int], int]:
    """(ids of a one-turn chat with its reply and end-of-turn, the last prompt position)."""
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": user}])
    end = tokenizer.encode("<|im_end|>")  # ChatML's end of turn, when the tokenizer has it as one id
    return prompt + tokenizer.encode(reply) + (end if len(end) == 1 else []), len(prompt) - 1


def gsm8k_solutions(path: str | Path) -> Iterator[tuple[str, str]]:
    """(question, cleaned solution) of each line of a GSM8K jsonl file, in file order."""
    with open(path, encoding="utf-8") as handle:
        for line in handle:
            if line.strip():
                row = json.loads(line)
                yield row["question"].strip(), clean_gsm8k_answer(row["answer"])


def clean_gsm8k_answer(answer: str) -> str:
    """Drop the calculator annotations ``<<a*b=c>>`` and state the final ``#### N`` as a sentence."""
    answer = re.sub(r"<<[^>]*>>", "", answer).strip()
    body, marker, final = answer.rpartition("####")
    if not marker:
        return answer
    return f"{body.strip()}\nThe answer is {final.strip()}."


def stdlib_files(root: str | Path | None = None) -> list[Path]:
    """The .py files of the standard library (``root`` default: this interpreter's), sorted, tests etc. left out."""
    root = Path(root or sysconfig.get_paths()["stdlib"])
    files = []
    for path in sorted(root.rglob("*.py")):
        parts = path.relative_to(root).parts
        if any(part in STDLIB_SKIP or part.startswith("config-") for part in parts[:-1]):
            continue
        files.append(path)
    return files


def stdlib_chunks(tokenizer, root: str | Path | None = None, chunk_tokens: int = 384) -> Iterator[tuple[str, str]]:
    """(module name, chunk of whole lines of about ``chunk_tokens`` tokens) over :func:`stdlib_files`."""
    base = Path(root or sysconfig.get_paths()["stdlib"])
    for path in stdlib_files(base):
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        name = ".".join(path.relative_to(base).with_suffix("").parts).removesuffix(".__init__")
        chunk, size = [], 0
        for line in text.splitlines(keepends=True):
            chunk.append(line)
            size += max(1, len(line) // 3)  # about 3 characters per token on code; exact counts are not needed
            if size >= chunk_tokens:
                yield name, "".join(chunk)
                chunk, size = [], 0
        if chunk and "".join(chunk).strip():
            yield name, "".join(chunk)


# ---- labelling -------------------------------------------------------------------------------------------


@dataclass
class LabelledSequence:
    source: int
    ids: torch.Tensor  # [N] int64
    label_start: int
    topk_ids: torch.Tensor  # [N - 1 - label_start, K] int32
    topk_probs: torch.Tensor  # [N - 1 - label_start, K] float16
    rest: torch.Tensor  # [N - 1 - label_start] float16


@torch.no_grad()
def label_sequence(target: Transformer, item: LabelItem, top_k: int, logit_rows: int = 128) -> LabelledSequence:
    """One teacher-forced target pass over ``item.ids``: top-k of p_target at positions label_start .. N - 2."""
    ids = torch.tensor(item.ids, dtype=torch.int64)
    last = target.config.num_layers - 1
    out = target(ids[None].to(target.device), hidden_layers=(last,), logits="none")
    hidden = out.hidden_states[0][0, item.label_start : len(item.ids) - 1]  # [R, D]
    return LabelledSequence(item.source, ids, item.label_start, *topk_labels(target, hidden, top_k, logit_rows))


def topk_labels(target: Transformer, hidden: torch.Tensor, top_k: int, logit_rows: int = 128
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The target's last-layer states hidden [R, D] -> (top-k ids int32 [R, K], their probabilities fp16 [R, K],
    rest mass fp16 [R]), the head run ``logit_rows`` rows at a time (a [R, 151936] fp32 block is large)."""
    topk_ids, topk_probs, rests = [], [], []
    for begin in range(0, hidden.shape[0], logit_rows):
        logits = target.lm_head(target.norm(hidden[begin : begin + logit_rows])).float()  # [r, V]
        probs = torch.softmax(logits, dim=-1)
        values, indices = probs.topk(top_k, dim=-1)  # [r, K], sorted descending
        topk_ids.append(indices.to(torch.int32).cpu())
        topk_probs.append(values.to(torch.float16).cpu())
        rests.append((1.0 - values.sum(-1)).clamp_min(0.0).to(torch.float16).cpu())
    return torch.cat(topk_ids), torch.cat(topk_probs), torch.cat(rests)


def write_label_shard(path: str | Path, sequences: Sequence[LabelledSequence]) -> None:
    """One shard file (atomic)."""
    path = Path(path)
    lengths = torch.tensor([len(s.ids) for s in sequences], dtype=torch.int64)
    rows = torch.tensor([s.topk_ids.shape[0] for s in sequences], dtype=torch.int64)
    zero = torch.zeros(1, dtype=torch.int64)
    tensors = {
        "tokens": torch.cat([s.ids.to(torch.int32) for s in sequences]),
        "offsets": torch.cat([zero, lengths.cumsum(0)]),
        "label_starts": torch.tensor([s.label_start for s in sequences], dtype=torch.int32),
        "row_offsets": torch.cat([zero, rows.cumsum(0)]),
        "sources": torch.tensor([s.source for s in sequences], dtype=torch.int32),
        "topk_ids": torch.cat([s.topk_ids for s in sequences]).contiguous(),
        "topk_probs": torch.cat([s.topk_probs for s in sequences]).contiguous(),
        "rest": torch.cat([s.rest for s in sequences]).contiguous(),
    }
    save_tensors_atomic(tensors, path)


def _append(out_dir: Path, manifest: dict, sequences: list[LabelledSequence], items_done: int, seconds: float) -> None:
    name = f"labels_{len(manifest['shards']):05d}.safetensors"
    write_label_shard(out_dir / name, sequences)
    manifest["shards"].append({"file": name, "num_sequences": len(sequences),
                               "num_tokens": sum(len(s.ids) for s in sequences),
                               "num_rows": sum(int(s.topk_ids.shape[0]) for s in sequences)})
    manifest["num_sequences"] += len(sequences)
    manifest["num_tokens"] += manifest["shards"][-1]["num_tokens"]
    manifest["num_rows"] += manifest["shards"][-1]["num_rows"]
    manifest["items_done"] = items_done
    manifest["seconds"] = round(seconds, 1)
    _write_manifest(out_dir, manifest)


def generate_labels(config: LabelConfig, target: Transformer, tokenizer) -> Path:
    """Label items until the stream (or ``max_items``) ends; resumes from the manifest. Returns out_dir.

    The progress bar shows labelled (prefilled) tokens per second of target compute.
    """
    from tqdm import tqdm

    out_dir = Path(config.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    settings = _settings(config)
    manifest = read_manifest(out_dir)
    if manifest is not None and manifest.get("settings") != settings:
        raise ValueError(f"{out_dir} holds labels made with other settings: {manifest.get('settings')} != {settings}")
    if manifest is None:
        manifest = {"version": MANIFEST_VERSION, "settings": settings, "shards": [], "num_sequences": 0,
                    "num_tokens": 0, "num_rows": 0, "items_done": 0, "seconds": 0.0}
        _write_manifest(out_dir, manifest)
    items_done, seconds = manifest["items_done"], manifest["seconds"]
    stream = label_items(config.sources, tokenizer, max_tokens=config.max_tokens, chunk_tokens=config.chunk_tokens)
    stream = itertools.islice(stream, items_done, config.max_items)
    buffer: list[LabelledSequence] = []
    buffered_tokens = 0
    bar = tqdm(total=config.max_items, initial=items_done, desc="labelling", unit="seq", disable=not config.progress,
               dynamic_ncols=True, smoothing=0.05)
    done_tokens = manifest["num_tokens"]
    try:
        for item in stream:
            begin = time.perf_counter()
            buffer.append(label_sequence(target, item, config.top_k, config.logit_rows))
            seconds += time.perf_counter() - begin
            items_done += 1
            buffered_tokens += len(item.ids)
            bar.update(1)
            bar.set_postfix(tok_s=f"{(done_tokens + buffered_tokens) / max(seconds, 1e-9):.0f}",
                            tokens=done_tokens + buffered_tokens, refresh=False)
            if buffered_tokens >= config.shard_tokens:
                _append(out_dir, manifest, buffer, items_done, seconds)
                done_tokens += buffered_tokens
                buffer, buffered_tokens = [], 0
    finally:  # interrupted or not: keep what was labelled
        if buffer:
            _append(out_dir, manifest, buffer, items_done, seconds)
        bar.close()
    return out_dir


# ---- reading ---------------------------------------------------------------------------------------------


@dataclass
class LabelledText:
    """One stored sequence with its soft labels (see the module docstring for the row <-> position rule)."""

    ids: torch.Tensor  # [N] int64
    label_start: int
    source: int
    topk_ids: torch.Tensor  # [N - 1 - label_start, K] int64
    topk_probs: torch.Tensor  # [N - 1 - label_start, K] float32
    rest: torch.Tensor  # [N - 1 - label_start] float32
    taps: torch.Tensor | None = None  # [N, T * Dt] the target's tapped hidden states (train/target_features.py)


class LabelShards:
    """Random access to labelled sequences of one or more directories (comma-separated); one shard in memory."""

    def __init__(self, data_dirs: str | Path | Sequence[str | Path]) -> None:
        if isinstance(data_dirs, (str, Path)):
            data_dirs = [d for d in str(data_dirs).split(",") if d]
        self.data_dirs = [Path(d) for d in data_dirs]
        self.entries: list[tuple[Path, dict]] = []  # (directory, shard entry)
        self.sources: list[list[str]] = []
        for directory in self.data_dirs:
            manifest = read_manifest(directory)
            if manifest is None:
                raise FileNotFoundError(f"no {MANIFEST} in {directory}")
            self.sources.append(manifest["settings"]["sources"])
            self.entries += [(directory, entry) for entry in manifest["shards"]]
        self.top_k = {read_manifest(d)["settings"]["top_k"] for d in self.data_dirs}
        self.starts = [0, *itertools.accumulate(entry["num_sequences"] for _, entry in self.entries)]
        self._loaded: tuple[int, dict[str, torch.Tensor]] | None = None

    def __len__(self) -> int:
        return self.starts[-1]

    def _shard(self, number: int) -> dict[str, torch.Tensor]:
        if self._loaded is None or self._loaded[0] != number:
            directory, entry = self.entries[number]
            with safe_open(str(directory / entry["file"]), framework="pt") as handle:
                self._loaded = (number, {name: handle.get_tensor(name) for name in handle.keys()})
        return self._loaded[1]

    def __getitem__(self, index: int) -> LabelledText:
        if not 0 <= index < len(self):
            raise IndexError(f"sequence {index} of {len(self)}")
        number = bisect.bisect_right(self.starts, index) - 1
        shard, local = self._shard(number), index - self.starts[number]
        begin, end = int(shard["offsets"][local]), int(shard["offsets"][local + 1])
        rows = slice(int(shard["row_offsets"][local]), int(shard["row_offsets"][local + 1]))
        return LabelledText(ids=shard["tokens"][begin:end].long(), label_start=int(shard["label_starts"][local]),
                            source=int(shard["sources"][local]), topk_ids=shard["topk_ids"][rows].long(),
                            topk_probs=shard["topk_probs"][rows].float(), rest=shard["rest"][rows].float())

    def source_spec(self, index: int) -> str:
        """The source (as configured, e.g. ``gsm8k:<path>``) that sequence ``index`` came from."""
        number = bisect.bisect_right(self.starts, index) - 1
        directory = self.data_dirs.index(self.entries[number][0])
        shard = self._shard(number)
        return self.sources[directory][int(shard["sources"][index - self.starts[number]])]

    def __iter__(self) -> Iterator[LabelledText]:
        return (self[i] for i in range(len(self)))


class HardLabels:
    """Token shards (``dflash2 train data``: the target's own greedy responses) read as labelled sequences whose
    label is the next token itself, with probability 1 (K = 1, rest 0): free labels for the response positions,
    exact where the text is the target's greedy choice. Same interface as :class:`LabelShards`."""

    def __init__(self, data_dirs: str | Path | Sequence[str | Path]) -> None:
        from dflash2.train.data import ShardSet

        self.shards = ShardSet(data_dirs, load_hidden=False)

    def __len__(self) -> int:
        return len(self.shards)

    def __getitem__(self, index: int) -> LabelledText:
        sequence = self.shards[index]
        start = max(sequence.prompt_length - 1, 0)
        next_ids = sequence.ids[start + 1 :]  # [R]
        return LabelledText(ids=sequence.ids, label_start=start, source=0, topk_ids=next_ids[:, None],
                            topk_probs=torch.ones(len(next_ids), 1), rest=torch.zeros(len(next_ids)))

    def split_heldout(self, count: int) -> tuple[list[int], list[int]]:
        return self.shards.split_heldout(count)
