"""`workbench serve`: prefill and decode on the roofline, per batch size; measured on the host, predicted for a target.

    workbench serve --preset small --target host --batch 1,8,32 --prompt-len 128 --gen-len 64
    workbench serve --preset llama3-8b --target tpu-v6e:2x2 --batch 1,16,128 --prompt-len 2048 --gen-len 256
    workbench serve --preset small --target host --batch 1 --draft tiny --draft-tokens 4
"""
from __future__ import annotations

from typing import Optional

import typer

from workbench.errors import WorkbenchError
from workbench.results.console import emit_json, fmt, print_table, stderr_console


def _batches(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise WorkbenchError(f"--batch {text!r}: give comma-separated sizes, e.g. 1,8,64") from None


def _ms(x):
    return fmt(x * 1e3) if x else "—"


def _rows(r: dict) -> list[dict]:
    rows = []
    for b in r["batches"]:
        rows.append({"batch": b["batch"],
                     "TTFT ms (meas / pred)": f"{_ms(b['ttft_s'])} / {_ms(b['predicted_ttft_s'])}",
                     "TPOT ms (meas / pred)": f"{_ms(b['tpot_s'])} / {_ms(b['predicted_tpot_s'])}",
                     "tokens/s": fmt(b["tokens_per_s"] or b["predicted_tokens_per_s"]),
                     "memory GB": fmt(b["memory_bytes"] / 1e9) if b["memory_bytes"] else "—",
                     "fits": "yes" if b["fits"] else "no",
                     "prefill": f"{b['prefill']['bound']} ({fmt(b['prefill']['intensity'])} F/B)",
                     "decode": f"{b['decode']['bound']} ({fmt(b['decode']['intensity'])} F/B)"})
    return rows


def register(app: typer.Typer) -> None:
    @app.command("serve")
    def serve_cmd(
        preset: str = typer.Option(..., "--preset", help="model preset (small, llama3-8b, ...)"),
        target: str = typer.Option("host", "--target", help="host (measured and predicted) or a TPU slice / GPU "
                                                            "node (predicted): tpu-v6e:2x2, h100:8, ..."),
        batch: str = typer.Option("1,8,32", "--batch", help="batch sizes, comma-separated"),
        prompt_len: int = typer.Option(128, "--prompt-len", help="prompt tokens per sequence"),
        gen_len: int = typer.Option(64, "--gen-len", help="generated tokens per sequence (the cache holds "
                                                          "prompt + generated)"),
        quant: str = typer.Option("none", "--quant", help="weights: none | int8 | int4 | fp8 (weight-only "
                                                          "by Qwix, per-channel scales; int4:g128 adds a scale per "
                                                          "group of 128 inputs)"),
        kv_dtype: str = typer.Option("auto", "--kv-dtype", help="KV cache: auto (the compute dtype) | bf16 | int8 "
                                                                "| fp8"),
        policy: Optional[str] = typer.Option(None, "--policy", help="precision policy (default float32 on the "
                                                                    "host, bf16 on a target)"),
        strategy: str = typer.Option("tp", "--strategy", help="targets: how the model is split (tp, fsdp, dp, ...)"),
        mesh: Optional[str] = typer.Option(None, "--mesh", help="targets: e.g. model=4 (default: the strategy's)"),
        set_: Optional[str] = typer.Option(None, "--set", help="model config overrides k=v,k=v"),
        draft: Optional[str] = typer.Option(None, "--draft", help="host: speculative decoding with this preset as "
                                                                  "the draft model"),
        draft_tokens: int = typer.Option(4, "--draft-tokens", help="tokens the draft proposes per round"),
        requests: Optional[str] = typer.Option(None, "--requests", help="host: continuous batching over a request "
                                               "stream: 'synthetic' or a JSON-lines file of {prompt, max_new}"),
        checkpoint: Optional[str] = typer.Option(None, "--checkpoint", help="host: serve the weights `workbench run "
                                                 "--checkpoint-dir DIR` saved (its newest step)"),
        paged: bool = typer.Option(False, "--paged", help="decode over a paged KV cache (host: the page-table gather form; "
                                   "TPU targets: JAX's Pallas paged attention kernel)"),
        page_size: int = typer.Option(16, "--page-size", help="positions per page of the paged cache"),
        temperature: float = typer.Option(0.0, "--temperature", help="host: sampling temperature of speculation "
                                          "(exact rejection sampling) and continuous batching; 0: greedy"),
        seed: int = typer.Option(0, "--seed"),
        plot: Optional[str] = typer.Option(None, "--plot", help="write the latency–throughput chart (PNG) here"),
        as_json: bool = typer.Option(False, "--json", help="JSON on stdout"),
    ):
        """Serving per batch size: time to first token, time per output token, tokens/s, memory, roofline, knee."""
        from workbench.programs.serve import ServeSpec, validate

        spec = ServeSpec(preset, target, _batches(batch), prompt_len, gen_len, quant, kv_dtype, policy, strategy,
                         mesh, set_, draft, draft_tokens, requests, seed, checkpoint=checkpoint, paged=paged,
                         page_size=page_size, temperature=temperature)
        validate(spec)
        if target != "host":
            from partitioning.topology import setup_target_devices

            setup_target_devices(target)
        else:
            from workbench.hardware.devices import default_platform

            default_platform()
        from workbench.programs.serve import serve

        con = stderr_console()
        with con.status(f"serving {preset} on {target}") as status:
            r = serve(spec, say=lambda s: status.update(s))
        if plot:
            from workbench.results.figures import serving_chart

            r["plot"] = serving_chart(r, plot)
        if as_json:
            emit_json(r)
            return
        print_table(_rows(r), list(_rows(r)[0]), title=f"workbench serve · {r['preset']} on {r['target']} · "
                    f"prompt {prompt_len} + {gen_len} · weights {quant} · KV {r['kv_dtype']}")
        k = r["knee"]
        print(f"decode turns compute-bound: {('at batch ' + str(k['batch'])) if k.get('batch') else 'never'} — "
              f"{k['why']}")
        if "speculative" in r:
            s = r["speculative"]
            print(f"speculative ({s['draft']}, k={s['draft_tokens']}): acceptance {s['acceptance_rate']:.0%}, "
                  f"{s['tokens_per_round']:.2f} tokens/round, speedup measured {s['measured_speedup']:.2f}x, "
                  f"predicted {s['predicted_speedup']:.2f}x")
        if "continuous_batching" in r:
            c = r["continuous_batching"]
            f = c["paged_cache"]
            print(f"continuous batching: {c['requests']} requests over {c['slots']} slots in {c['decode_steps']} "
                  f"steps, {c['tokens_per_s']:.1f} tokens/s; a paged cache (pages of {f.get('page_size')}) holds "
                  f"{f['paged_positions_peak']} positions at the busiest step against {f['contiguous_positions']} "
                  f"reserved contiguously")
