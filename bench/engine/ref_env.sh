#!/usr/bin/env bash
# The official generators' environments for bench/engine/side_by_side.py on the GPU machine
# (python 3.12, x86_64, no internet; its image has torch 2.11, transformers 5.17 with
# huggingface-hub 1.33 and tokenizers 0.23.2, and requests, einops, safetensors, regex, pyyaml,
# fsspec, hf-xet, as its package list reads), and the few official source files the script
# loads. Run from the repository root. Three subcommands:
#
#   bash bench/engine/ref_env.sh pack [SET...]      (here, with PyPI; default SETs: tf449 tf457)
#       downloads the wheels that put one reference transformers in front of the machine's own,
#       installs them for python 3.12 into a scratch folder and packs that folder as
#       .whl-ref/SET.tar.xz (about 5-6 MB each, against 13-15 MB of wheels: the working tree
#       that travels to the GPU is limited to 64 MiB in all):
#         tf449  transformers 4.49.0, tokenizers 0.21.4 (Fast-dLLM's pin: --family llada, dream)
#         tf452  transformers 4.52.4, tokenizers 0.21.4 (JetAstra/SDAR's config: --family sdar)
#         tf457  transformers 4.57.6, tokenizers 0.22.2 (dFactory's LLaDA2: --family llada2;
#                the machine's tokenizers 0.23.2 is above its <= 0.23.0)
#       each with huggingface-hub 0.36.2 (all three need < 1.0). No dependencies are resolved:
#       the rest is the machine's own.
#   bash bench/engine/ref_env.sh refsrc MIRRORS     (here)
#       writes .refsrc/<owner>+<repo>/ with only the files side_by_side.py's loaders read, at
#       the commits the reference vectors were made from (tests/data/refvectors), from git
#       directories MIRRORS/<owner>+<repo>/repo (the search tool's fetch leaves them there),
#       and a COMMIT file in each (about 450 kB in all).
#   bash bench/engine/ref_env.sh install SET TARGET (on the GPU machine, .whl-ref carried)
#       unpacks .whl-ref/SET.tar.xz into TARGET; then run the benchmark with
#       PYTHONPATH=TARGET:/tmp/site (the reference's transformers first, FlashInfer after it).
#
# .refsrc and .whl-ref are ignored through .git/info/exclude and carried to the GPU by name;
# the project never copies official code into tracked files.
set -euo pipefail
cmd=${1:-pack}
shift || true
PLATFORM=(--python-version 3.12 --implementation cp --only-binary=:all:
          --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64
          --platform manylinux2014_x86_64)

pack() {
  local sets=("$@") tmp
  [ ${#sets[@]} -gt 0 ] || sets=(tf449 tf457)
  tmp=$(mktemp -d)
  trap 'rm -rf "$tmp"' RETURN
  mkdir -p .whl-ref
  for s in "${sets[@]}"; do
    case $s in
      tf449) pkgs=(transformers==4.49.0 tokenizers==0.21.4) ;;
      tf452) pkgs=(transformers==4.52.4 tokenizers==0.21.4) ;;
      tf457) pkgs=(transformers==4.57.6 tokenizers==0.22.2) ;;
      *) echo "unknown set $s (tf449, tf452, tf457)" >&2; exit 2 ;;
    esac
    python3 -m pip download -q --no-deps "${PLATFORM[@]}" -d "$tmp/$s.whl" "${pkgs[@]}" \
      huggingface-hub==0.36.2
    python3 -m pip install -q --no-index --no-deps --no-compile "${PLATFORM[@]}" \
      --target "$tmp/$s" "$tmp/$s.whl"/*.whl
    rm -rf "$tmp/$s/bin"  # console scripts, with this machine's interpreter in their shebang
    XZ_OPT=-9e tar cJf ".whl-ref/$s.tar.xz" -C "$tmp/$s" .
    ls -la "$tmp/$s.whl"
  done
  ls -la .whl-ref
}

# <owner>+<repo> <commit> <file>...: what the loaders of side_by_side.py read (and nothing else).
REFSRC=(
  "NVlabs+Fast-dLLM 24cc59e75f20a6384bae8c905965bb090b96388e llada/generate.py
   llada/model/__init__.py llada/model/configuration_llada.py llada/model/modeling_llada.py
   dream/model/__init__.py dream/model/configuration_dream.py dream/model/modeling_dream.py
   dream/model/generation_utils.py dream/model/generation_utils_block.py"
  "inclusionAI+dFactory 92b6890808088b112fcf5fc73a341b78b6ab76bf
   models/llada2_moe/configuration_llada2_moe.py models/llada2_moe/modeling_llada2_moe.py"
  "JetAstra+SDAR c2041a8333333d685f6e15122c84f60f51f85ebd generate.py
   training/model/SDAR-4B-Chat/configuration_sdar.py training/model/SDAR-4B-Chat/modeling_sdar.py
   evaluation/opencompass/opencompass/models/huggingface_bd3.py"
)

refsrc() {
  local mirrors=${1:?usage: ref_env.sh refsrc MIRRORS}
  for entry in "${REFSRC[@]}"; do
    # shellcheck disable=SC2086
    set -- $entry
    local repo=$1 commit=$2
    shift 2
    rm -rf ".refsrc/$repo"
    for f in "$@"; do
      mkdir -p ".refsrc/$repo/$(dirname "$f")"
      git --git-dir="$mirrors/$repo/repo" show "$commit:$f" > ".refsrc/$repo/$f"
    done
    echo "$commit" > ".refsrc/$repo/COMMIT"
  done
  du -sh .refsrc/* .refsrc
}

install() {
  local usage="usage: ref_env.sh install SET TARGET"
  local set=${1:?$usage} target=${2:?$usage}
  mkdir -p "$target"
  python3 -c "import sys, tarfile; tarfile.open(sys.argv[1]).extractall(sys.argv[2], \
filter='data')" ".whl-ref/$set.tar.xz" "$target"
}

case $cmd in
  pack) pack "$@" ;;
  refsrc) refsrc "$@" ;;
  install) install "$@" ;;
  *) echo "usage: ref_env.sh pack [SET...] | refsrc MIRRORS | install SET TARGET" >&2; exit 2 ;;
esac
