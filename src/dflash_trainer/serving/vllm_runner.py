"""Run by a python that has vLLM (``serving.launch`` starts it; nothing of this package is imported
here): greedy generation of token-id prompts by ``vllm.LLM`` on the target alone and with each DFlash
export as its drafter.

    python vllm_runner.py JOB.json
    python vllm_runner.py --serve TARGET [--dtype D] [--max-model-len N]
    python vllm_runner.py --extract TARGET OPTIONS_JSON

JOB: {"target": DIR, "prompts": [[id, ...], ...], "max_tokens": N, "exports": {name: DIR or null},
"output": PATH}. Writes to ``output``: {name: {"tokens": [[id, ...], ...], "drafts": n,
"accepted": n, "seconds": s, "startup_seconds": s}}, ``drafts``/``accepted`` from vLLM's own
counters (``vllm:spec_decode_num_drafts`` / ``vllm:spec_decode_num_accepted_tokens``), or
{name: {"error": "one line"}} where vLLM refuses the export.

``--serve`` keeps one ``vllm.LLM`` of TARGET and answers each stdin line {"prompts", "max_tokens",
"temperature", "top_p", "seed"} with one stdout line ``@@dflash-trainer {"completions": [[text,
new tokens without the eos, cut at max_tokens], ...]}`` (``serving.engines.VllmEngine``); vLLM's
own log shares stdout, hence the marker.

``--extract`` keeps one ``vllm.LLM(TARGET, **OPTIONS)`` running (OPTIONS: vLLM's
``extract_hidden_states`` method and the ``dflash_hidden_states`` connector, from
``serving.hidden_states.extraction_args``, plus the capture's own engine arguments; the connector's
folder on PYTHONPATH) and answers each stdin line {"prompts": [[id, ...], ...]} with
``@@dflash-trainer {"files": [path per prompt]}`` once every file is complete.
"""

import atexit
import gc
import json
import sys
import time


# vLLM runs the garbage collector several times per engine (twice per model it loads, three times as
# it freezes its heap after starting, once at shutdown), and each full collection walks every object
# that importing vLLM, torch and transformers made; so does each of the full collections the import
# itself triggers (one each time the heap grows by a quarter). Frozen (``gc.freeze``, as vLLM's engine
# freezes its own heap once started; cli.freeze_startup_heap, which cannot be imported here, does the
# same for our own processes), those objects are left out: the import takes 7.1 CPU-s instead of 9.6,
# the tiny target with a DFlash drafter starts in 1.7 s instead of 3.4, each further engine of
# ``main``'s loop in 0.9 s instead of 2.7 (one core, 2026-12-07). Unfrozen at exit, so that the
# interpreter's last collection still frees them (nanobind prints the instances it finds alive at
# exit as leaks).
def _freeze_survivors(phase: str, info: dict) -> None:
    if phase == "stop" and info["generation"] == 2:
        gc.freeze()


gc.callbacks.append(_freeze_survivors)  # while vLLM, torch and transformers import
from vllm import LLM, SamplingParams  # noqa: E402
from vllm.inputs import TokensPrompt  # noqa: E402

gc.callbacks.remove(_freeze_survivors)
gc.freeze()
atexit.register(gc.unfreeze)


def one_line(exc: BaseException) -> str:
    """An exception as one line: pydantic's validation errors span several, with the cause in the
    middle (vLLM's config checks raise inside its config classes)."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip() and "errors.pydantic.dev" not in line]
    return f"{type(exc).__name__}: {' '.join(lines)}"[:500]


def counters(llm) -> dict:
    found = {}
    for metric in llm.get_metrics():
        if metric.name in ("vllm:spec_decode_num_drafts", "vllm:spec_decode_num_accepted_tokens"):
            found[metric.name.rsplit("_", 1)[-1]] = int(metric.value)
    return {"drafts": found.get("drafts", 0), "accepted": found.get("tokens", 0)}


def main(job_path: str) -> None:
    job = json.load(open(job_path))
    params = SamplingParams(temperature=0.0, max_tokens=job["max_tokens"])
    prompts = [TokensPrompt(prompt_token_ids=ids) for ids in job["prompts"]]
    results = {}
    for name, export in job["exports"].items():
        t0 = time.perf_counter()
        spec = None
        if export:
            spec = {"method": "dflash", "model": export, "num_speculative_tokens": job.get("num_speculative_tokens", 7)}
        try:
            llm = LLM(
                model=job["target"],
                dtype="float32",
                enforce_eager=True,
                max_model_len=job.get("max_model_len", 2048),
                speculative_config=spec,
                disable_log_stats=False,
            )
        except Exception as exc:  # what vLLM refuses to serve is a result too
            results[name] = {"error": one_line(exc)}
            print(name, results[name]["error"], flush=True)
            continue
        startup = time.perf_counter() - t0
        t0 = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        seconds = time.perf_counter() - t0
        results[name] = {
            "tokens": [list(o.outputs[0].token_ids) for o in outs],
            "seconds": seconds,
            "startup_seconds": startup,
            **counters(llm),
        }
        print(name, json.dumps({k: v for k, v in results[name].items() if k != "tokens"}), flush=True)
        del llm
        gc.collect()
        gc.freeze()  # the engine's shutdown unfroze everything (EngineCore.shutdown): again, without it
    json.dump(results, open(job["output"], "w"))


MARK = "@@dflash-trainer "


def serve(argv: list[str]) -> None:
    import argparse

    p = argparse.ArgumentParser()
    p.add_argument("target")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--max-model-len", type=int, default=None)
    args = p.parse_args(argv)

    def say(obj):
        print(MARK + json.dumps(obj), flush=True)

    try:
        llm = LLM(model=args.target, dtype=args.dtype, max_model_len=args.max_model_len, enforce_eager=True)
    except Exception as exc:
        say({"error": one_line(exc)})
        return
    say({"ready": True})
    for line in sys.stdin:
        job = json.loads(line)
        params = [
            SamplingParams(
                temperature=job["temperature"],
                top_p=job["top_p"],
                seed=job["seed"] + i if job["temperature"] > 0 else None,
                max_tokens=job["max_tokens"],
            )
            for i in range(len(job["prompts"]))
        ]
        outs = llm.generate([TokensPrompt(prompt_token_ids=ids) for ids in job["prompts"]], params, use_tqdm=False)
        completions = []
        for o in outs:
            c = o.outputs[0]
            cut = c.finish_reason == "length"
            n = len(c.token_ids) if cut else max(0, len(c.token_ids) - 1)  # a stop by eos holds the eos
            completions.append([c.text, n, cut])
        say({"completions": completions})


def extract(argv: list[str]) -> None:
    target, options = argv[0], {"enforce_eager": True, **json.loads(argv[1])}

    def say(obj):
        print(MARK + json.dumps(obj), flush=True)

    try:
        llm = LLM(model=target, **options)
    except Exception as exc:
        say({"error": one_line(exc)})
        return
    say({"ready": True})
    params = SamplingParams(temperature=0.0, max_tokens=1)
    for line in sys.stdin:
        job = json.loads(line)
        try:
            outs = llm.generate([TokensPrompt(prompt_token_ids=ids) for ids in job["prompts"]], params, use_tqdm=False)
        except Exception as exc:  # a prompt vLLM refuses (too long, ...): said, and the run ends
            say({"error": one_line(exc)})
            return
        say({"files": [o.kv_transfer_params["hidden_states_path"] for o in outs]})


if __name__ == "__main__":
    if sys.argv[1] == "--serve":
        serve(sys.argv[2:])
    elif sys.argv[1] == "--extract":
        extract(sys.argv[2:])
    else:
        main(sys.argv[1])
