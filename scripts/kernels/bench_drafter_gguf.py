#!/usr/bin/env python
"""The PARD drafter's cost on the gguf kernel, A/B between builds of gemm_gguf_avx2.cpp, interleaved in one process.

Loads the engine as `dflash2 run --weights gguf` does (the default drafter, `auto`: the 0.5B merged with its adapter,
Q4_0 blocks quantized at load, a 65536-id draft vocabulary head) and times, per build, with the same weight tensors:

  linears m=R   the 24 layers' four projections (q/k/v, o, gate/up, down) on R random rows, in the model's order
                (the ~201 MB of Q4_0 blocks streamed from memory, as a pass reads them)
  head m=R      the draft vocabulary head (65536 x 896) on R rows, fp32 logits
  propose k=K   one draft pass of K drafts (PardDrafter.propose: 1 pending id + K - 1 masks over 300 cached ids,
                greedy), every decoder layer through that build's fused layer (gguf_layer)

Builds: `installed` (the package's, built as usual) and each directory of --variants holding an edited copy of
gemm_gguf_avx2.cpp and the headers it includes, built here under its own op namespace (nothing installed is touched).
A build name may end in @N: that build with its pairs from N rows (gguf_pair_min_rows). Every round runs every build
(the order reversed every other round); medians, and per round each build's time over the first's.

    nice -n 10 python scripts/kernels/bench_drafter_gguf.py --variants /tmp/v1 --threads 1 --cpu-time
    nice -n 10 python scripts/kernels/bench_drafter_gguf.py --builds installed@1,installed@4 --rows 1,2,3
"""

from __future__ import annotations

import argparse
import re
import statistics
import time
from pathlib import Path

import torch


def build_variant(directory: Path, tag: str) -> str:
    """gemm_gguf_avx2.cpp in ``directory`` built as op namespace dflash2_gguf_<tag>, with the compiler flags of the
    build this CPU runs (AVX2, AVX512-VNNI or AMX-INT8: what `installed` is)."""
    from torch.utils.cpp_extension import load

    from dflash2.kernels import gguf_linear as gl
    from dflash2.kernels import jit

    namespace = f"dflash2_gguf_{re.sub(r'[^A-Za-z0-9_]', '_', tag)}"
    out = directory / f"build_{namespace}"
    out.mkdir(exist_ok=True)
    cflags = [f for f in gl._BUILDS[gl.gguf_backend()].cflags if not f.startswith("-DDFLASH2_GGUF_NS=")]
    load(name=namespace, sources=[str(directory / "gemm_gguf_avx2.cpp")],
         extra_cflags=[*cflags, f"-DDFLASH2_GGUF_NS={namespace}"], extra_include_paths=[str(directory)],
         extra_ldflags=jit.LDFLAGS, is_python_module=False, build_directory=str(out))
    return namespace


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--variants", default="", help="comma-separated directories with an edited gemm_gguf_avx2.cpp")
    ap.add_argument("--builds", default="", help="which builds to time, in order (default: installed + variants); "
                                                 "NAME@N: with its pairs from N rows")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--cpu-time", action="store_true", help="the process's CPU time instead of the wall clock")
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--rows", default="1,4,9", help="rows for the linears and the head")
    ap.add_argument("--ks", default="1,3,8", help="drafts per timed draft pass")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    import dflash2
    from dflash2.kernels import gguf_linear as gl
    from dflash2.verify.sampling import SamplingParams

    eng = dflash2.load(weights="gguf", drafter="auto")
    pard = eng.drafter.block
    model = pard.model
    head = model.lm_head.head
    namespaces = {"installed": gl.build_namespace(gl.gguf_backend())}
    for path in filter(None, args.variants.split(",")):
        namespaces[Path(path).name] = build_variant(Path(path), Path(path).name)
    builds = args.builds.split(",") if args.builds else list(namespaces)
    clock = time.process_time if args.cpu_time else time.perf_counter
    linears = [(layer.attn.wqkv, layer.attn.wo, layer.ffn.w_gate_up, layer.ffn.w_down) for layer in model.layers]

    def cpp_weights(namespace: str, linear):
        w = getattr(torch.classes, namespace).GgufWeights()
        for pb in linear.parts:
            w.add_run(pb.weight, pb.scale, pb.offset, pb.sub_scales, pb.offset_mult, pb.bits, pb.signed, pb.zero,
                      pb.sub, pb.group, pb.out_features)
        if linear.bias_data is not None:
            w.set_bias(linear.bias_data.contiguous())
        return w

    setups = {}
    for name in builds:
        base, _, pairs = name.partition("@")
        namespace = namespaces[base]
        ops = getattr(torch.ops, namespace)
        weights = [[cpp_weights(namespace, p) for p in ps] for ps in linears]
        handles = []
        for layer, four in zip(model.layers, weights):
            handle = getattr(torch.classes, namespace).GgufLayer()
            handle.set(layer.attn_norm.weight.detach(), layer.ffn_norm.weight.detach(), float(layer.attn_norm.eps),
                       *four, layer.attn.num_heads, layer.attn.num_kv_heads)
            handles.append(handle)
        setups[name] = dict(ops=ops, pairs=int(pairs) if pairs else gl.pair_min_rows(), weights=weights,
                            layers=(ops.gguf_layer.default, ops.gguf_layer_segments.default, handles),
                            head=(ops.gguf_linear.default, cpp_weights(namespace, head)))

    def use(name: str) -> dict:
        s = setups[name]
        s["ops"].gguf_pair_min_rows(s["pairs"])
        model._gguf_layers = s["layers"]  # (gguf_layer._layer_handles' cache: this build's fused layers)
        head._weights = s["head"]
        return s

    seq, params = list(range(1000, 1300)), SamplingParams(temperature=0.0)

    def propose(name: str, k: int) -> float:
        use(name)
        pard.reset(len(seq) + 64)
        pard.prefill(seq[:-1])
        start = clock()
        pard.propose(seq, k, params, None)
        return clock() - start

    def run_linears(name: str, m: int) -> float:
        s = use(name)
        op = s["ops"].gguf_linear.default
        xs = [torch.randn(m, p.in_features).bfloat16() for p in linears[0]]
        start = clock()
        for four in s["weights"]:
            for w, x in zip(four, xs):
                op(x, w)
        return clock() - start

    def run_head(name: str, m: int) -> float:
        op, w = use(name)["head"]
        x = torch.randn(m, head.in_features).bfloat16()
        start = clock()
        op(x, w, True)
        return clock() - start

    rows, ks = [int(r) for r in args.rows.split(",")], [int(k) for k in args.ks.split(",")]
    times: dict[tuple[str, str], list[float]] = {}
    with torch.no_grad():
        drafts = {}
        for name in builds:
            use(name)
            pard.reset(len(seq) + 64)
            pard.prefill(seq[:-1])
            drafts[name] = pard.propose(seq, 8, params, None).tokens
        same = all(torch.equal(drafts[builds[0]], d) for d in drafts.values())
        for r in range(args.rounds + 1):  # (round 0: a warm-up)
            for name in (builds if r % 2 else builds[::-1]):
                cases = [(f"linears m={m}", lambda m=m: run_linears(name, m)) for m in rows]
                cases += [(f"head m={m}", lambda m=m: run_head(name, m)) for m in rows]
                cases += [(f"propose k={k}", lambda k=k: propose(name, k)) for k in ks]
                for case, fn in cases:
                    t = fn()
                    if r:
                        times.setdefault((case, name), []).append(t)
    print(f"{platform_line()}; threads={args.threads}, {'CPU time' if args.cpu_time else 'wall clock'}, "
          f"{args.rounds} rounds; the same 8 drafts from every build: {same}")
    print("| case | " + " | ".join(f"{b} ms" for b in builds) + " | " + " | ".join(f"{b} / {builds[0]}"
                                                                               for b in builds[1:]) + " |")
    print("| --- " * (2 * len(builds)) + "|")
    for case in dict.fromkeys(c for c, _ in times):
        first = times[(case, builds[0])]
        meds = [f"{statistics.median(times[(case, b)]) * 1e3:.2f}" for b in builds]
        ratios = [f"{statistics.median([y / x for x, y in zip(first, times[(case, b)])]):.3f}" for b in builds[1:]]
        print(f"| {case} | " + " | ".join(meds + ratios) + " |")


def platform_line() -> str:
    """The CPU's name, vendor, family and model (:func:`dflash2.platform.cpu`)."""
    from dflash2.platform import cpu

    info = cpu()
    return f"cpu: {info.name or info.machine} (vendor {info.vendor}, family {info.family}, model {info.model})"


if __name__ == "__main__":
    main()
