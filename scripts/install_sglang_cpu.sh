#!/usr/bin/env bash
# Add SGLang's CPU backend (its Intel AMX kernels; on AVX-512 bf16 CPUs without AMX, adaptivespec's AVX-512 mode) to the active venv from the prebuilt wheels.
#
#   scripts/install_sglang_cpu.sh            # inside an activated venv with torch 2.13.0+cpu
#
# Wheel folder: $ADAPTIVESPEC_SGLANG_WHEELS, else <repo>/../shared/sglang-cpu, else
# /work/shared/sglang-cpu. Idempotent: re-running with everything in place only checks.
# Exits 0 with one line saying why when there is nothing to install here (no wheel folder, or a CPU
# with neither AMX nor AVX-512 bf16, where SGLang's CPU backend cannot run speculative decoding): CI
# must not fail for that; the real-server tests skip with the same reason. On AVX-512 bf16 without
# AMX, adaptivespec runs SGLang in its AVX-512 mode (docs/serving.md; ADAPTIVESPEC_SGLANG_AVX512=0: off).
set -euo pipefail
repo="$(cd "$(dirname "$0")/.." && pwd)"

flags="$(grep -m1 '^flags' /proc/cpuinfo 2>/dev/null || true)"
has() { case " ${flags#*:} " in *" $1 "*) return 0 ;; *) return 1 ;; esac; }
if has amx_bf16; then
    echo "install_sglang_cpu: this CPU has AMX: SGLang's CPU backend as upstream supports it"
elif has avx512f && has avx512_bf16 && [ "${ADAPTIVESPEC_SGLANG_AVX512:-1}" != "0" ]; then
    echo "install_sglang_cpu: this CPU has AVX-512 bf16 and no AMX: SGLang's CPU backend in adaptivespec's AVX-512 mode"
else
    echo "install_sglang_cpu: skipped: this CPU has neither AMX (amx_bf16) nor AVX-512 bf16 (avx512_bf16) in /proc/cpuinfo${ADAPTIVESPEC_SGLANG_AVX512:+ (or ADAPTIVESPEC_SGLANG_AVX512=$ADAPTIVESPEC_SGLANG_AVX512)}; SGLang's CPU backend needs one"
    exit 0
fi
wheels=""
for d in "${ADAPTIVESPEC_SGLANG_WHEELS:-}" "$repo/../shared/sglang-cpu" /work/shared/sglang-cpu; do
    if [ -n "$d" ] && ls "$d"/sglang-0.5.23-*.whl >/dev/null 2>&1 && ls "$d"/sglang_kernel_cpu-*.whl >/dev/null 2>&1; then
        wheels="$(cd "$d" && pwd)"; break
    fi
done
if [ -z "$wheels" ]; then
    echo "install_sglang_cpu: skipped: no SGLang CPU wheel folder (set ADAPTIVESPEC_SGLANG_WHEELS, or provide ../shared/sglang-cpu)"
    exit 0
fi
if [ -z "${VIRTUAL_ENV:-}" ]; then
    echo "install_sglang_cpu: error: activate the venv first (. .venv/bin/activate)" >&2
    exit 2
fi
torch_version="$(python -c 'import torch; print(torch.__version__)' 2>/dev/null || echo none)"
case "$torch_version" in
    2.13.0*) ;;
    *) echo "install_sglang_cpu: error: the venv has torch $torch_version; the kernel wheel needs torch 2.13.0 (+cpu)" >&2; exit 2 ;;
esac

# System libraries: libnuma (kernels), numactl, tcmalloc and tbbmalloc (LD_PRELOAD at launch).
missing=()
for pkg in libnuma-dev numactl google-perftools libtbb-dev; do
    dpkg -s "$pkg" >/dev/null 2>&1 || missing+=("$pkg")
done
if [ "${#missing[@]}" -gt 0 ]; then
    if [ "$(id -u)" = "0" ] && command -v apt-get >/dev/null; then
        apt="apt-get -o DPkg::Lock::Timeout=600 -y -q"  # another install may hold the dpkg lock: wait for it
        ($apt install "${missing[@]}" >/dev/null 2>&1 || { $apt update >/dev/null 2>&1 && $apt install "${missing[@]}" >/dev/null; }) \
            || echo "install_sglang_cpu: warning: apt-get could not install ${missing[*]}; the server runs without the preloads"
    else
        echo "install_sglang_cpu: warning: missing system packages ${missing[*]} (install them as root); the server runs without the preloads"
    fi
fi

# Python side: pin torch so pip can never swap it for a CUDA build.
pin="$(mktemp)"; trap 'rm -f "$pin" "$pin.req"' EXIT
echo "torch==$torch_version" > "$pin"
# keep the project's transformers: SGLang's list pins 5.19.0, whose forward takes no cache= keyword
# (adaptivespec's runtime needs >= 5.24); SGLang 0.5.23 serves the embedded pair on 5.24 (tested)
tf_version="$(python -c 'import transformers; print(transformers.__version__)' 2>/dev/null || true)"
[ -n "$tf_version" ] && echo "transformers==$tf_version" >> "$pin"
# and its xgrammar: SGLang's list pins 0.2.7, which lacks find_jump_forward_tokens (structured output,
# adaptivespec[structured] needs >= 0.2.9)
xg_version="$(python -c 'import importlib.metadata as m; print(m.version("xgrammar"))' 2>/dev/null || true)"
[ -n "$xg_version" ] && echo "xgrammar==$xg_version" >> "$pin"
if python - <<'PY' 2>/dev/null
import importlib.metadata as m, sys
ok = m.version("sglang") == "0.5.23" and m.version("sglang-kernel-cpu").startswith("0.4") and m.version("torchvision") == "0.28.0"
sys.exit(0 if ok else 1)
PY
then
    echo "install_sglang_cpu: sglang 0.5.23 + CPU kernels already installed"
else
    pip install -q --no-warn-conflicts -c "$pin" "$wheels"/sglang_kernel_cpu-*.whl
    pip install -q --no-warn-conflicts --no-deps "$wheels"/sglang-0.5.23-*.whl
    grep -v -e '^transformers==' -e '^xgrammar==' "$wheels/requirements-cpu.txt" > "$pin.req"
    pip install -q --no-warn-conflicts -c "$pin" -r "$pin.req"
    pip install -q --no-warn-conflicts --no-deps torchvision==0.28.0
fi
# sglang imports torchvision; PyPI's torchvision is a CUDA build whose two fake-op registrations
# fail without its CUDA ops: guard them (a no-op when already guarded).
tv="$(python -c 'import importlib.util as u; print(u.find_spec("torchvision").submodule_search_locations[0])')/_meta_registrations.py"
sed -i 's/^@torch.library.register_fake("torchvision::\(q\?nms\)")/@(torch.library.register_fake("torchvision::\1") if torchvision.extension._has_ops() else (lambda f: f))/' "$tv"
[ -n "$tf_version" ] && python -c "import transformers, sys; sys.exit(transformers.__version__ != '$tf_version')" \
    || { [ -n "$tf_version" ] && pip install -q --no-warn-conflicts "transformers==$tf_version"; }
[ -n "$xg_version" ] && python -c "import importlib.metadata as m, sys; sys.exit(m.version('xgrammar') != '$xg_version')" \
    || { [ -n "$xg_version" ] && pip install -q --no-warn-conflicts "xgrammar==$xg_version"; }
python -c 'import torch; assert torch.__version__.startswith("2.13.0"), torch.__version__; import sglang, sgl_kernel; print("install_sglang_cpu: ready: sglang", sglang.__version__, "torch", torch.__version__)'
