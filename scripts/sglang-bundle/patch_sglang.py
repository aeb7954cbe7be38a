"""Source edits that let SGLang 0.5.17 start on the GPU image's transformers 5.x without flashinfer.

    python3 scripts/sglang-bundle/patch_sglang.py SITE_DIR

Each edit replaces one exact block of a file under SITE_DIR and leaves the marker
``# [vitrify bundle]`` on the new text. Running again is harmless (edited files are recognised by
the new text). Any block found zero times or more than once stops the script with a message
naming the file: the pinned SGLang changed and the edit must be looked at again.

Why each edit:

* ``sglang/srt/configs/qwen3_asr.py`` registers the ``qwen3_asr`` and ``qwen3_asr_thinker``
  configs with transformers' ``AutoConfig``. transformers 5.x ships its own ``qwen3_asr``, and a
  second registration raises at import; ``exist_ok=True`` keeps the one transformers has.
* Three modules import flashinfer at module level on CUDA. flashinfer is not in the bundle (it
  is large and JIT-compiles); the server runs with ``--attention-backend triton
  --sampling-backend pytorch``, where none of the imported functions is called, so each import
  becomes optional: ``sampler.py`` (flashinfer sampling kernels), ``quantization/fp8_utils.py``
  (a batched fp8 matmul), ``attention/vision.py`` (a cuDNN prefill for vision encoders).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

MARK = "# [vitrify bundle]"


@dataclass(frozen=True)
class Edit:
    path: str
    old: str
    new: str


def _optional_import(indent: str, import_block: str, fallback: str) -> str:
    """``import_block`` (already indented by ``indent``) wrapped in try/except ImportError."""
    inner = "".join(f"    {line}\n" for line in import_block.splitlines())
    return (f"{indent}try:  {MARK} flashinfer is not in the bundle\n{inner}"
            f"{indent}except ImportError:\n{indent}    {fallback}\n")


EDITS = [
    Edit("sglang/srt/configs/qwen3_asr.py",
         'AutoConfig.register("qwen3_asr", Qwen3ASRConfig)\n',
         f'AutoConfig.register("qwen3_asr", Qwen3ASRConfig, exist_ok=True)  {MARK}\n'),
    Edit("sglang/srt/configs/qwen3_asr.py",
         'AutoConfig.register("qwen3_asr_thinker", Qwen3ASRThinkerConfig)\n',
         f'AutoConfig.register("qwen3_asr_thinker", Qwen3ASRThinkerConfig, exist_ok=True)  {MARK}\n'),
    Edit("sglang/srt/layers/sampler.py",
         "if is_cuda():\n"
         "    from flashinfer.sampling import (\n"
         "        min_p_sampling_from_probs,\n"
         "        top_k_top_p_sampling_from_probs,\n"
         "    )\n",
         "if is_cuda():\n" + _optional_import(
             "    ",
             "    from flashinfer.sampling import (\n"
             "        min_p_sampling_from_probs,\n"
             "        top_k_top_p_sampling_from_probs,\n"
             "    )",
             "pass")),
    Edit("sglang/srt/layers/quantization/fp8_utils.py",
         "    from flashinfer import bmm_fp8 as _raw_bmm_fp8_batched\n",
         _optional_import("    ", "    from flashinfer import bmm_fp8 as _raw_bmm_fp8_batched",
                          "_raw_bmm_fp8_batched = None")),
    Edit("sglang/srt/layers/attention/vision.py",
         "if _is_cuda:\n    from flashinfer.prefill import cudnn_batch_prefill_with_kv_cache\n",
         "if _is_cuda:\n" + _optional_import(
             "    ", "    from flashinfer.prefill import cudnn_batch_prefill_with_kv_cache",
             "cudnn_batch_prefill_with_kv_cache = None")),
]


def apply(site: Path) -> list[str]:
    """Apply every edit under ``site``; return one line per edit saying what happened."""
    report = []
    for e in EDITS:
        f = site / e.path
        if not f.is_file():
            raise SystemExit(f"patch_sglang: {f} is missing (is {site} an unpacked SGLang 0.5.17?)")
        text = f.read_text()
        if e.new in text:
            report.append(f"already edited  {e.path}")
            continue
        n = text.count(e.old)
        if n != 1:
            first = e.old.strip().splitlines()[0]
            raise SystemExit(f"patch_sglang: {e.path}: expected the block starting {first!r} "
                             f"once, found it {n} times")
        f.write_text(text.replace(e.old, e.new))
        report.append(f"edited          {e.path}")
    return report


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print("usage: " + __doc__.strip().splitlines()[2].strip(), file=sys.stderr)
        return 2
    for line in apply(Path(argv[1])):
        print(f"patch_sglang: {line}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
