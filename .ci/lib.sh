# Functions the scripts in .ci/ share (sourced, from the repository's root).

# apt_install PACKAGE...: Debian packages (as root); the lock timeout waits for another apt run
# instead of failing.
apt_install() {
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq -o DPkg::Lock::Timeout=600
  apt-get install -y -qq --no-install-recommends -o DPkg::Lock::Timeout=600 "$@" >/dev/null
}

# ensure_tools TOOL...: installs from Debian the tools asked for that this machine lacks: clang (or
# another compiler, by its command, as its Debian package is named), ccache, aarch64-gcc (the
# cross compiler and its C library) and qemu-aarch64 (user-mode emulation).
ensure_tools() {
  local tool packages=()
  for tool in "$@"; do
    case $tool in
      aarch64-gcc) command -v aarch64-linux-gnu-gcc >/dev/null || packages+=(gcc-aarch64-linux-gnu libc6-dev-arm64-cross) ;;
      qemu-aarch64) command -v qemu-aarch64 >/dev/null || command -v qemu-aarch64-static >/dev/null || packages+=(qemu-user) ;;
      *) command -v "$tool" >/dev/null || packages+=("$tool") ;;
    esac
  done
  ((${#packages[@]} == 0)) || { echo "installing ${packages[*]}" && apt_install "${packages[@]}"; }
}

# copy_sources DEST: the sources as the repository has them, without builds, in a new DEST,
# for a leg that builds the extension its own way while other legs use the working tree's.
copy_sources() {
  local dest=$1
  rm -rf "$dest"
  mkdir -p "$dest"
  if git rev-parse --is-inside-work-tree >/dev/null 2>&1; then
    git ls-files -z | xargs -0 cp --parents -t "$dest"
  else  # an unpacked sdist
    tar --exclude=./build --exclude='./.venv*' --exclude='*.so' -cf - . | tar -C "$dest" -xf -
  fi
}
