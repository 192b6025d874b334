"""Generation engines outside this process for ``dflash-train generate``: any OpenAI-compatible server
(``--server URL``: vLLM, SGLang) and vLLM offline (``--engine vllm``: one ``vllm.LLM`` kept in a
subprocess of the python that has vLLM, ``serving.launch``).

Both take token-id prompts (the chat template is applied once, by the caller, as training reads it)
and always send ``max_tokens`` (a model's generation_config may otherwise cap replies). A completion is
``(text, new tokens without the eos, cut at max_tokens)``; the text is the engine's own decoding with
special tokens skipped, as ``inference.regenerate`` decodes.
"""

from __future__ import annotations

import collections
import http.client
import json
import os
import subprocess
import urllib.error
import urllib.parse
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field

from ..errors import UserError, check_schema

Completion = tuple[str, int, bool]
# How long the first request (/v1/models) may take to connect and answer: a listener that accepts and
# never answers (a wrong port, a hung server) is named, not waited on. A completion may take longer
# (the server answers when the whole reply is generated): each waits up to COMPLETION_TIMEOUT.
DEFAULT_PROBE_TIMEOUT = 30.0  # seconds; DFLASH_SERVER_TIMEOUT overrides it, read when a server is probed
COMPLETION_TIMEOUT = 600.0


def _probe_timeout() -> float:
    value = os.environ.get("DFLASH_SERVER_TIMEOUT", "")
    try:
        seconds = float(value) if value else DEFAULT_PROBE_TIMEOUT
    except ValueError:
        raise UserError(f"DFLASH_SERVER_TIMEOUT must be a number of seconds, got {value!r}") from None
    if not 0 < seconds < float("inf"):
        raise UserError(f"DFLASH_SERVER_TIMEOUT must be a positive number of seconds, got {value!r}")
    return seconds


# The answers this client reads, typed (OpenAI's schema, the fields used; others are ignored).
class _Answer(BaseModel):
    model_config = ConfigDict(extra="allow")


class _Model(_Answer):
    id: str


class _Models(_Answer):
    data: list[_Model]


class _Choice(_Answer):
    text: str
    finish_reason: str | None = None


class _Usage(_Answer):
    completion_tokens: int = Field(0, ge=0)


class _Completion(_Answer):
    choices: list[_Choice] = Field(min_length=1)
    usage: _Usage | None = None


def _sampling(temperature: float, top_p: float, seed: int) -> dict:
    return {"temperature": temperature, "top_p": top_p if temperature > 0 else 1.0, "seed": seed}


class ServerEngine:
    """``/v1/completions`` of an OpenAI-compatible server, one request per prompt, sent concurrently
    (the server batches them)."""

    def __init__(self, url: str, model: str | None = None, timeout: float = COMPLETION_TIMEOUT):
        parts = urllib.parse.urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.netloc:
            raise UserError(f"--server {url} is not an http(s) URL: write it as http://HOST:PORT")
        self.url = url.rstrip("/")
        self.timeout = timeout
        served = self._served_model()  # always: a server that does not answer is named at once
        self.model = model or served

    def _request(self, path: str, schema, body: dict | None = None, timeout: float | None = None):
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(f"{self.url}{path}", data, {"Content-Type": "application/json"})
        timeout = timeout or self.timeout
        try:
            with urllib.request.urlopen(req, timeout=timeout) as r:
                raw = r.read()
        except urllib.error.HTTPError as exc:
            detail = exc.read().decode(errors="replace")[:300].replace("\n", " ")
            raise UserError(f"the server at {self.url} answered {path} with HTTP {exc.code}: {detail}") from None
        except TimeoutError:
            raise UserError(
                f"the server at {self.url} did not answer {path} within {timeout:g} s: is it an OpenAI-compatible "
                "server, and is it up? (DFLASH_SERVER_TIMEOUT sets the first request's wait)"
            ) from None
        except (urllib.error.URLError, OSError) as exc:
            reason = getattr(exc, "reason", exc)
            if isinstance(reason, TimeoutError):
                raise UserError(f"the server at {self.url} did not accept a connection within {timeout:g} s") from None
            raise UserError(f"cannot reach the server at {self.url}: {reason}") from None
        except http.client.HTTPException as exc:
            raise UserError(
                f"the server at {self.url} did not answer {path} in HTTP ({type(exc).__name__}): is the URL an "
                "OpenAI-compatible server (vLLM, SGLang)?"
            ) from None
        try:
            answer = json.loads(raw)
        except ValueError:
            shown = raw[:60].decode(errors="replace").replace("\n", " ")
            raise UserError(
                f"the server at {self.url} answered {path} with something that is not JSON ({shown!r}): is the URL "
                "an OpenAI-compatible server (vLLM, SGLang)?"
            ) from None
        where = f"the server at {self.url} answered {path}"
        return check_schema(schema, answer, where, "is the URL an OpenAI-compatible server (vLLM, SGLang)?")

    def _served_model(self) -> str:
        models = self._request("/v1/models", _Models, timeout=min(_probe_timeout(), self.timeout)).data
        if not models:
            raise UserError(f"the server at {self.url} serves no model (/v1/models is empty)")
        return models[0].id

    def complete(self, prompts: list[list[int]], max_tokens: int, temperature: float, top_p: float, seed: int):
        def one(i_ids):
            i, ids = i_ids
            body = {
                "model": self.model,
                "prompt": ids,
                "max_tokens": max_tokens,
                **_sampling(temperature, top_p, seed + i),
            }
            answer = self._request("/v1/completions", _Completion, body)
            c = answer.choices[0]
            cut = c.finish_reason == "length"
            n = answer.usage.completion_tokens if answer.usage else 0
            return c.text, n if cut else max(0, n - 1), cut  # a stop by eos counts the eos token

        with ThreadPoolExecutor(max(1, min(64, len(prompts)))) as pool:
            return list(pool.map(one, enumerate(prompts)))

    def close(self) -> None:
        pass


class RunnerProcess:
    """``vllm_runner.py`` in a subprocess of the python that has vLLM: one JSON job per stdin line, one
    answer per job on its stdout after a marker prefix (vLLM's own log shares stdout)."""

    MARK = "@@dflash-trainer "

    def __init__(self, cmd: list[str], env: dict):
        self.proc = subprocess.Popen(
            cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, bufsize=1
        )
        self._read()  # the ready line: the engine is built

    def _read(self) -> dict:
        log = collections.deque(maxlen=5)  # vLLM's own log lines, for the error if it dies
        for line in self.proc.stdout:
            if line.startswith(self.MARK):
                answer = json.loads(line[len(self.MARK) :])
                if "error" in answer:
                    raise UserError(f"vLLM: {answer['error']}")
                return answer
            if line.strip():
                log.append(line.strip())
        last = log[-1] if log else "(no output)"
        raise UserError(f"vLLM exited (status {self.proc.wait()}) before answering: {last}")

    def ask(self, job: dict) -> dict:
        self.proc.stdin.write(json.dumps(job) + "\n")
        self.proc.stdin.flush()
        return self._read()

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.close()
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()


class VllmEngine(RunnerProcess):
    """One ``vllm.LLM`` of ``target`` in a subprocess (``vllm_runner.py --serve``), fed batches of
    token-id prompts over its stdin; its answers come back on its stdout after a marker line prefix."""

    def __init__(self, target: Path, *, dtype: str = "auto", max_model_len: int | None = None, python=None):
        from .launch import RUNNER, vllm_env, vllm_python

        python = python or vllm_python()
        cmd = [str(python), str(RUNNER), "--serve", str(Path(target).resolve()), "--dtype", dtype]
        if max_model_len:
            cmd += ["--max-model-len", str(max_model_len)]
        super().__init__(cmd, vllm_env(Path(python)))

    def complete(self, prompts: list[list[int]], max_tokens: int, temperature: float, top_p: float, seed: int):
        job = {"prompts": prompts, "max_tokens": max_tokens, **_sampling(temperature, top_p, seed)}
        return [tuple(c) for c in self.ask(job)["completions"]]
