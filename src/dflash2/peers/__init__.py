"""Peer runners: the tools people use today, run on dflash2's bench prompts (optional extra ``peers``).

Nothing in the core imports this package; ``dflash2 bench --peers ...`` does, lazily.
"""

from __future__ import annotations

from typing import Sequence

from dflash2.peers.base import Peer, PeerError, PeerResult, PeerSetup

TRANSFORMERS_PEERS = ("transformers", "transformers-assisted", "transformers-pld")
LLAMA_CPP_PEERS = ("llamacpp", "llamacpp-spec", "llamacpp-dflash", "llamacpp-ngram")
PEER_NAMES = TRANSFORMERS_PEERS + LLAMA_CPP_PEERS

__all__ = ["PEER_NAMES", "Peer", "PeerError", "PeerResult", "PeerSetup", "build_peers", "parse_peer_names"]


def parse_peer_names(spec: str | None) -> tuple[str, ...]:
    """``"transformers,llamacpp"`` -> names, in PEER_NAMES order; ``"all"`` -> every peer; unknown names raise."""
    if not spec:
        return ()
    names = PEER_NAMES if spec == "all" else tuple(n.strip() for n in spec.split(",") if n.strip())
    unknown = [n for n in names if n not in PEER_NAMES]
    if unknown:
        raise ValueError(f"unknown peer(s) {', '.join(unknown)}; choose from {', '.join(PEER_NAMES)} or all")
    return tuple(n for n in PEER_NAMES if n in names)  # plain siblings first: the others compare with them


def build_peers(names: Sequence[str], setup: PeerSetup) -> list[Peer]:
    """Load the requested peers (models, library, tool), in the order of ``names``."""
    built: dict[str, Peer] = {}
    hf_names = [n for n in names if n in TRANSFORMERS_PEERS]
    if hf_names:
        from dflash2.peers.hf import build_transformers_peers

        built.update({peer.name: peer for peer in build_transformers_peers(hf_names, setup)})
    if "llamacpp" in names:
        from dflash2.peers.llamacpp import LlamaCppPlainPeer

        built["llamacpp"] = LlamaCppPlainPeer(setup)
    speculative = {"llamacpp-spec": "LlamaCppSpeculativePeer", "llamacpp-dflash": "LlamaCppDFlashPeer",
                   "llamacpp-ngram": "LlamaCppNgramPeer"}
    for name, class_name in speculative.items():
        if name in names:
            from dflash2.peers import llamacpp

            built[name] = getattr(llamacpp, class_name)(setup, name)
    return [built[name] for name in names]
