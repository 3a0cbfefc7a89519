"""Loading a PARD drafter's network: the base model from the store with the adapter merged in, in the weight format
the drafter runs (drafters/pard.py), and the store's cache of the result.

Merging the LoRA adapter and quantizing the merged weights to Q8_0 blocks was most of a ``dflash2 generate``
before its first token (the 0.5B: ~35 s of CPU on the AMD EPYC Zen 4, 2 cores), redone at every load because the
store caches the base's layers, not the merge. So the merged, converted network is kept in the store beside its
base, in the packed-model cache's file format (:class:`~dflash2.models.packed_cache.ModelCache`)::

    models/<base>/<dtype>-pard-<weights>-<adapter>-<hash of its path>/drafter.safetensors

keyed, in its metadata, by everything that decides its bytes: the adapter's files (their sha256: a checkout or
a copy that changes their times does not rebuild it), the base's files (size and mtime), the weight format and
load dtype, and a hash of the code that merges, quantizes and packs. A file that does not match or does not fit is
reported by one warning and rebuilt. Cached: Q8_0 / Q4_0 blocks and packed bf16 on a CPU, without a reading twin
(the twin's bf16 copy is built from the merge); ``DFLASH2_QUANT_CACHE=off`` turns it off.
"""

from __future__ import annotations

import functools
import hashlib
import inspect
import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from torch import nn

from dflash2.drafters import lora
from dflash2.drafters.lora import LORA_TARGETS, add_lora, load_adapter_state, merge_lora
from dflash2.models.config import ModelConfig
from dflash2.models.decoder import Transformer, float_outputs
from dflash2.models.validate import ModelFileError, check_safetensors

PARD_CONFIG = "pard_config.json"
ADAPTER_FILE = "adapter.safetensors"
DRAFT_VOCAB_FILE = "draft_vocab.safetensors"  # optional: "draft_vocab" int64 [V'], the ids the head drafts


@dataclass(frozen=True)
class PardConfig:
    """A trained PARD adapter: what it adapts and how (``pard_config.json``)."""

    base_model: str  # the store name (or directory) of the drafter's base network
    mask_token_id: int  # the id at the mask positions (its embedding row is replaced by ``mask_embedding``)
    num_draft_tokens: int = 8  # trained draft length k (k - 1 mask positions)
    default_num_draft_tokens: int | None = None  # the k measured fastest (`dflash2 bench`); None: the trained k
    lora_rank: int = 16  # 0 = no adapters (only the mask embedding)
    lora_alpha: float = 32.0  # the adapter's update is (alpha / rank) * B @ A
    lora_targets: tuple[str, ...] = LORA_TARGETS
    target_model: str = ""  # the target it was distilled from (informative: PARD drafts for the family)
    extra: dict = field(default_factory=dict)  # training record (steps, data, held-out acceptance)

    def save(self, directory: str | Path) -> None:
        data = asdict(self)
        data["lora_targets"] = list(self.lora_targets)
        (Path(directory) / PARD_CONFIG).write_text(json.dumps(data, indent=2) + "\n")

    @classmethod
    def load(cls, directory: str | Path) -> "PardConfig":
        path = Path(directory) / PARD_CONFIG
        try:
            data = json.loads(path.read_text())
            data["lora_targets"] = tuple(data["lora_targets"])
            return cls(**data)
        except (OSError, ValueError, TypeError, KeyError) as error:
            raise ModelFileError(path, f"is not a PARD adapter config ({type(error).__name__}: {error})") from None


def default_mask_token_id(vocab_size: int) -> int:
    """The last embedding row (unused by the Qwen2.5 tokenizer, whose 151665 ids end before it)."""
    return vocab_size - 1


def initial_mask_embedding(model: Transformer, used_ids: int | None = None) -> torch.Tensor:
    """[D] float32: the mean embedding of the first ``used_ids`` ids (default: all)."""
    rows = model.embed.weight[: used_ids or model.config.vocab_size]
    return rows.float().mean(dim=0)


def load_pard_model(adapter_dir: str | Path | None, base_dir: str | Path, dtype: str = "bf16",
                    device: str = "cpu", *, packed: bool | None = None, mask_token_id: int | None = None,
                    weights: str = "bf16", draft_vocab: bool = True) -> tuple[Transformer, PardConfig]:
    """The drafter's network and its config: :func:`load_pard_networks` without a prompt reader."""
    model, config, _ = load_pard_networks(adapter_dir, base_dir, dtype, device, packed=packed,
                                          mask_token_id=mask_token_id, weights=weights, draft_vocab=draft_vocab)
    return model, config


def load_pard_networks(adapter_dir: str | Path | None, base_dir: str | Path, dtype: str = "bf16",
                       device: str = "cpu", *, packed: bool | None = None, mask_token_id: int | None = None,
                       weights: str = "bf16", draft_vocab: bool = True, reader: bool = False
                       ) -> tuple[Transformer, PardConfig, Transformer | None]:
    """The base network with a trained adapter merged in (or untrained: ``adapter_dir`` None, the mask embedding
    is then the mean embedding). Packed for the CPU kernel when ``packed`` (None: as ``load_transformer``).
    ``weights`` "int8" / "int4": the MERGED projections and the head quantized (weight-only, CPU kernels; quantized
    at each load, ~1 s per 100M weights); "q8_0" / "q4_0": quantized to Q8_0 / Q4_0 blocks and run by the gguf
    kernels (activations quantized per 32 inputs as well). Blocks and packed bf16 are read from the store's cache
    when it holds this merge (see the module docstring).
    ``draft_vocab``: when the adapter directory has ``draft_vocab.safetensors``, the head keeps only those rows
    (:class:`VocabSubsetHead`: logits of the other ids are -inf, so they are never drafted; the head is 28% of the
    0.5B's weights at the full 151936 ids).
    ``reader`` (with Q8_0 / Q4_0 blocks only, else None): also a twin of the network for reading long prompts
    (:func:`reading_twin`), the third item."""
    from dflash2.models.huge_pages import move_linear_weights
    from dflash2.models.loading import WEIGHT_FORMATS, check_weight_format, parse_dtype, should_pack

    formats = (*(f for f in WEIGHT_FORMATS if f != "gguf"), *BLOCK_FORMATS)  # no GGUF file holds a merged drafter
    if weights not in formats:
        raise ValueError(f"unknown pard drafter weight format {weights!r}; choose one of {', '.join(formats)}")
    if weights not in BLOCK_FORMATS:
        check_weight_format(weights, device)
    elif torch.device(device).type != "cpu":
        raise ValueError(f"pard drafter weights {weights} run on the CPU only (device {device!r})")
    pack = weights == "bf16" and (packed if packed is not None else should_pack(device, parse_dtype(dtype)))
    base_config = ModelConfig.from_dir(base_dir)
    if adapter_dir is None:
        config = PardConfig(base_model=str(base_dir), lora_rank=0,
                            mask_token_id=mask_token_id if mask_token_id is not None
                            else default_mask_token_id(base_config.vocab_size))
    else:
        config = PardConfig.load(adapter_dir)
    vocab = read_draft_vocab(adapter_dir) if draft_vocab and adapter_dir is not None else None
    if vocab is not None:
        # ascending ids: the first of equal draft-vocabulary logits is then the lowest id, as the full-vocabulary
        # argmax picks (a greedy draft is the argmax over the head's own rows: PardDrafter._draft_from_part)
        vocab = vocab.sort().values
        if bool((vocab == config.mask_token_id).any()):
            raise ValueError("the draft vocabulary must not contain the mask token")
    reads = reader and weights in BLOCK_FORMATS
    cache = None if reads else drafter_cache(adapter_dir, base_dir, config, dtype, device, weights, pack, vocab)
    model = twin = None
    if cache is not None:
        model = cache.read(base_config, parse_dtype(dtype), None if vocab is None else {"lm_head": len(vocab)})
    if model is None:
        model = merged_network(adapter_dir, base_dir, config, dtype, device, vocab)
        twin = reading_twin(model) if reads else None
        convert_layers(model, weights, pack)
        if cache is not None:
            cache.write(model)
    move_linear_weights(model)  # packed / quantized weights onto huge pages (models/huge_pages.py)
    if vocab is not None:
        model.lm_head = VocabSubsetHead(model.lm_head, vocab, model.config.vocab_size)
    if twin is not None:
        twin.lm_head = model.lm_head  # (a read computes no logits; the twin is a whole network all the same)
    return model.eval().requires_grad_(False), config, twin


def merged_network(adapter_dir: str | Path | None, base_dir: str | Path, config: PardConfig, dtype: str,
                   device: str, vocab: torch.Tensor | None) -> Transformer:
    """The base network (unpacked) with the adapter merged, the mask embedding in its row and the head cut to the
    draft vocabulary ``vocab`` (ascending ids) when there is one."""
    from safetensors.torch import load_file

    from dflash2.models.loading import load_transformer

    model = load_transformer(base_dir, dtype, device, packed=False)
    if adapter_dir is None:
        mask_embedding = initial_mask_embedding(model, used_ids=config.mask_token_id)
    else:
        adapter_file = Path(adapter_dir) / ADAPTER_FILE
        check_safetensors(adapter_file)  # offsets and sizes against the file: one line if not
        state = load_file(str(adapter_file))
        try:  # a missing or misshapen tensor, or a mask id outside the vocabulary: one line naming the file
            if not 0 <= config.mask_token_id < model.config.vocab_size:
                raise KeyError(f"mask_token_id {config.mask_token_id} (the vocabulary has {model.config.vocab_size})")
            if config.lora_rank > 0:
                add_lora(model, config.lora_rank, config.lora_alpha, config.lora_targets)
                load_adapter_state(model, state)
                merge_lora(model)
            mask_embedding = state["mask_embedding"].reshape(model.config.hidden_size)
        except (KeyError, RuntimeError) as error:
            reason = f"no {error.args[0]}" if isinstance(error, KeyError) else str(error)
            raise ModelFileError(adapter_file, f"does not fit the base network {base_dir}: {reason}") from None
    model.embed.weight.data[config.mask_token_id] = mask_embedding.to(model.dtype)
    if vocab is not None:
        full = model.lm_head
        with torch.device("meta"):  # (no random initialisation of a weight replaced at once)
            model.lm_head = nn.Linear(full.in_features, len(vocab), bias=False, dtype=full.weight.dtype)
        model.lm_head.weight = nn.Parameter(full.weight.data[vocab].clone(), requires_grad=False)
    return model


def convert_layers(model: Transformer, weights: str, pack: bool) -> None:
    """The merged projections and head in the drafter's weight format: GGUF blocks quantized from the merge,
    weight-only int8 / int4, or packed bf16 (``pack``); each layer then owns its memory."""
    from dflash2.kernels.gguf_linear import GgufLinear
    from dflash2.models.loading import own_memory, pack_linear_layers
    from dflash2.models.state_dict import quantize_linear_layers, replace_linear_layers

    if weights in BLOCK_FORMATS:  # the gguf kernels over Q8_0 / Q4_0 blocks quantized from the merged weights
        qtype = BLOCK_FORMATS[weights]
        replace_linear_layers(model, lambda linear: GgufLinear.from_linear(linear, qtype=qtype))
    elif weights != "bf16":
        quantize_linear_layers(model, weights)
    elif pack:
        pack_linear_layers(model)
    else:
        return
    own_memory(model)


def reading_twin(model: Transformer) -> Transformer:
    """A twin of ``model`` (merged, not yet quantized) whose projections run the packed bf16 kernel: the same
    embedding, norms and buffers (shared), its own projections (the head: the caller's to share). On AMX tiles a
    prompt of 170 ids costs the 0.5B 115 ms in bf16 against 237 ms in Q8_0 blocks, whose tile products store and
    scale every block of 32 inputs per row (docs/pard.md, Intel Xeon (AMX)); a few rows cost less in Q8_0 (half the
    bytes), so the drafter keeps its blocks for its draft passes (:attr:`CachedModelDrafter.reader`)."""
    import copy

    from dflash2.models.loading import own_memory, pack_linear_layers

    twin = copy.deepcopy(model, memo={id(t): t for t in (*model.parameters(), *model.buffers())})  # modules only
    pack_linear_layers(twin, include_head=False)  # the projections' packed copies (not on huge pages: no faster reads)
    return own_memory(twin).eval().requires_grad_(False)


def read_draft_vocab(adapter_dir: str | Path) -> torch.Tensor | None:
    """The adapter's draft vocabulary (int64 [V'] ids), or None when it has none (the full vocabulary)."""
    from safetensors.torch import load_file

    path = Path(adapter_dir) / DRAFT_VOCAB_FILE
    if not path.exists():
        return None
    if "draft_vocab" not in check_safetensors(path):
        raise ModelFileError(path, "is missing", "tensor draft_vocab")
    return load_file(str(path))["draft_vocab"].to(torch.int64)


class VocabSubsetHead(nn.Module):
    """The head over a subset of the vocabulary: ``head`` computes the logits of ``ids`` [V'] only; the output is
    [..., vocab_size] float32 with -inf at every other id (never drafted: q_draft is 0 there, so verification
    stays exact)."""

    def __init__(self, head: nn.Module, ids: torch.Tensor, vocab_size: int) -> None:
        super().__init__()
        self.head = head
        self.register_buffer("ids", ids.to(torch.int64), persistent=False)
        self.vocab_size = vocab_size

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., D] -> [..., V]
        return self.expand(self.part(x))

    def part(self, x: torch.Tensor) -> torch.Tensor:
        """[..., D] -> float32 [..., V'] logits of ``ids`` only."""
        return float_outputs(self.head, x)

    def expand(self, part: torch.Tensor) -> torch.Tensor:
        """[..., V'] logits of ``ids`` -> [..., vocab_size] with -inf at every other id."""
        full = torch.full((*part.shape[:-1], self.vocab_size), float("-inf"), device=part.device)
        return full.index_copy_(-1, self.ids.to(part.device), part)


Q8_0 = "q8_0"  # a drafter-only format: Q8_0 blocks quantized at load, the gguf kernels (load_pard_model)
Q4_0 = "q4_0"  # the same with Q4_0 blocks (4.5 bits per weight)
# drafter-only formats: the merged weights quantized at load to these GGUF block types, run by the gguf kernels
BLOCK_FORMATS = {Q8_0: "Q8_0", Q4_0: "Q4_0"}


# ---- the store's cache of the merged network ---------------------------------------------------------------

CACHE_VERSION = "1"
CACHE_FILE = "drafter.safetensors"
CACHE_MARK = "-pard-"  # in the cache's folder name: <dtype>-pard-<weights>-<adapter> (models/inventory.py)


def drafter_cache(adapter_dir: str | Path | None, base_dir: str | Path, config: PardConfig, dtype: str,
                  device: str, weights: str, pack: bool, vocab: torch.Tensor | None):
    """The cache of this merge (a :class:`~dflash2.models.packed_cache.ModelCache`), or None where it is not
    cached: disabled, a base outside the store, off the CPU, int8 / int4 (their layers have their own cache format,
    of the base's weights), unpacked bf16, or no kernel to pack for."""
    from dflash2.kernels import packed_linear as pl
    from dflash2.models.packed_cache import ModelCache
    from dflash2.models.quant_cache import _dtype_name, cache_enabled, source_identity, store_source
    from dflash2.models.state_dict import parse_dtype

    if torch.device(device).type != "cpu" or not cache_enabled():
        return None
    source = store_source(Path(base_dir))
    backend = pl.default_backend() if pack else None
    if source is None or (weights not in BLOCK_FORMATS and (backend is None or backend == pl.TORCH)):
        return None
    load = _dtype_name(parse_dtype(dtype))
    if adapter_dir is None:
        label, adapter = "untrained", f"untrained, mask id {config.mask_token_id}"
    else:
        adapter_dir = Path(adapter_dir).resolve()
        path_hash = hashlib.sha256(str(adapter_dir).encode()).hexdigest()[:8]
        label, adapter = f"{adapter_dir.name}-{path_hash}", adapter_identity(adapter_dir, vocab is not None)
    folder = f"{source.name}{'' if load == source.name else f'-as-{load}'}{CACHE_MARK}{weights}-{label}"
    metadata = {"dflash2_pard_cache": CACHE_VERSION, "weights": weights, "dtype": load, "adapter": adapter,
                "base": source_identity(source), "code": code_tag(),
                "draft_vocab": "none" if vocab is None else str(len(vocab))}
    if backend is not None:
        metadata["backend"] = backend
    return ModelCache(source.parent / folder / CACHE_FILE, metadata, kind="merged pard drafter cache")


def adapter_identity(adapter_dir: Path, with_vocab: bool) -> str:
    """sha256 of the adapter's files that the merged network is made of (its config, its tensors, and its draft
    vocabulary when the head is cut to it): ~16 MB for the shipped adapter, ~30 ms of CPU to hash."""
    digest = hashlib.sha256()
    for name in (PARD_CONFIG, ADAPTER_FILE, *((DRAFT_VOCAB_FILE,) if with_vocab else ())):
        digest.update(name.encode() + b"\0" + (adapter_dir / name).read_bytes())
    return digest.hexdigest()[:32]


@functools.lru_cache(maxsize=None)
def code_tag() -> str:
    """A hash of the code that decides the cached bytes: the merge and conversion here, the LoRA module, Q8_0 /
    Q4_0 quantization, the block packing (models/gguf_cache.py's tag), the bf16 panels (packed_cache's tag) and
    torch's version."""
    from dflash2.kernels import gguf_quantize
    from dflash2.kernels.gguf_linear import GgufLinear
    from dflash2.models import gguf_cache, packed_cache

    sources = [inspect.getsource(f) for f in (merged_network, convert_layers, initial_mask_embedding,
                                              GgufLinear.from_weight)]
    sources += [Path(m.__file__).read_text() for m in (lora, gguf_quantize)]
    # torch's own arithmetic makes the merge (fp32 products): another version may round it otherwise
    sources += [gguf_cache.layout_tag(), packed_cache.layout_tag(), json.dumps(BLOCK_FORMATS), torch.__version__]
    return hashlib.sha256("\n".join(sources).encode()).hexdigest()[:16]
