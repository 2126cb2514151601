#!/usr/bin/env bash
# Build the lab node image: Debian 12 (bookworm) with systemd as PID 1, sshd and
# Python, from debootstrap, imported into podman. No registry is used.
# Cached: does nothing when the image already exists (FORCE=1 rebuilds).
set -euo pipefail

here=$(cd "$(dirname "$0")" && pwd)
repo=$(cd "$here/../.." && pwd)
image=${LAB_IMAGE:-localhost/sglang-deploy-node:bookworm}
mirror=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
suite=bookworm
ca_bundle=${LAB_CA_BUNDLE:-/etc/ssl/certs/ca-certificates.crt}
build_root=${LAB_BUILD_DIR:-/var/tmp/sglang-deploy-image-build}

# The image is rebuilt when its recipe changes: this script and the lab's GPU double.
recipe=$(cat "$here/build.sh" "$repo"/lab/gpu_sim/* | sha256sum | cut -c1-16)
if [[ "${FORCE:-0}" != 1 ]] && podman image exists "$image"; then
  have=$(podman image inspect --format '{{ index .Labels "sglang-deploy.recipe" }}' "$image" 2>/dev/null || true)
  if [[ "$have" == "$recipe" ]]; then
    echo "image $image is up to date (recipe $recipe; FORCE=1 rebuilds)"
    exit 0
  fi
  echo "image $image has recipe ${have:-none}, want $recipe: rebuilding"
fi

packages=(
  systemd systemd-sysv dbus openssh-server sudo ca-certificates
  python3 python3-venv python3-apt python3-packaging iproute2 procps psmisc patch less
)

rm -rf "$build_root"
mkdir -p "$build_root"
trap 'rm -rf "$build_root"' EXIT
rootfs="$build_root/rootfs"

echo "debootstrap $suite into $rootfs"
debootstrap --variant=minbase --include="$(IFS=,; echo "${packages[*]}")" \
  "$suite" "$rootfs" "$mirror" >"$build_root/debootstrap.log" 2>&1 || {
  tail -n 40 "$build_root/debootstrap.log" >&2
  echo "debootstrap failed; full log above" >&2
  exit 1
}

# The host's CA bundle, so that the proxy in front of the registries is trusted.
install -m 0644 "$ca_bundle" "$rootfs/usr/local/share/ca-certificates/host-bundle.crt"
install -m 0644 "$ca_bundle" "$rootfs/etc/ssl/certs/ca-certificates.crt"

# Same apt sources as the host, plus security updates.
cat >"$rootfs/etc/apt/sources.list" <<SRC
deb $mirror $suite main
deb $mirror $suite-updates main
deb ${mirror%/debian}/debian-security $suite-security main
SRC

# The user Ansible connects as, like on production hosts: key only, sudo without password.
chroot "$rootfs" useradd --create-home --shell /bin/bash ansible
echo 'ansible ALL=(ALL) NOPASSWD: ALL' >"$rootfs/etc/sudoers.d/ansible"
chmod 0440 "$rootfs/etc/sudoers.d/ansible"
install -d -m 0700 -o 1000 -g 1000 "$rootfs/home/ansible/.ssh"

# sshd: keys only; host keys are made at first boot so each node has its own.
rm -f "$rootfs"/etc/ssh/ssh_host_*
cat >"$rootfs/etc/ssh/sshd_config.d/lab.conf" <<'SSHD'
PasswordAuthentication no
KbdInteractiveAuthentication no
PermitRootLogin no
UseDNS no
SSHD
cat >"$rootfs/etc/systemd/system/ssh-hostkeys.service" <<'UNIT'
[Unit]
Description=Generate SSH host keys (lab node first boot)
Before=ssh.service
ConditionPathExists=!/etc/ssh/ssh_host_ed25519_key

[Service]
Type=oneshot
ExecStart=/usr/bin/ssh-keygen -A

[Install]
WantedBy=multi-user.target
UNIT
chroot "$rootfs" systemctl enable ssh-hostkeys.service ssh.service >/dev/null

# Units that make no sense in a container.
for unit in systemd-timesyncd.service apt-daily.timer apt-daily-upgrade.timer \
            getty@tty1.service console-getty.service systemd-logind.service; do
  chroot "$rootfs" systemctl mask "$unit" >/dev/null 2>&1 || true
done
echo 'container' >"$rootfs/etc/hostname"
: >"$rootfs/etc/machine-id"

# Lab-only test double: the simulated nvidia-smi (never installed by roles).
install -d "$rootfs/usr/local/lib/lab-gpu-sim"
install -m 0644 "$repo/lab/gpu_sim/nvsim.py" "$rootfs/usr/local/lib/lab-gpu-sim/nvsim.py"
install -m 0755 "$repo/lab/gpu_sim/nvidia-smi" "$rootfs/usr/local/bin/nvidia-smi"
install -m 0755 "$repo/lab/gpu_sim/lab-gpu" "$rootfs/usr/local/bin/lab-gpu"

# Lab-only model directories: a config.json each, no weights. The target's architecture
# is the seed's; the draft is an EAGLE-3 draft, as validation checks against the algorithm.
install -d -m 0755 "$rootfs/srv/models/lab-target" "$rootfs/srv/models/lab-eagle3-draft"
echo '{"architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3"}' >"$rootfs/srv/models/lab-target/config.json"
echo '{"architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama"}' >"$rootfs/srv/models/lab-eagle3-draft/config.json"
chmod 0644 "$rootfs"/srv/models/*/config.json

chroot "$rootfs" apt-get clean
rm -rf "$rootfs"/var/lib/apt/lists/* "$rootfs"/var/cache/apt/*.bin

echo "importing into podman as $image"
tar -C "$rootfs" -c . | podman import \
  --change 'CMD ["/sbin/init"]' \
  --change 'STOPSIGNAL=SIGRTMIN+3' \
  --change 'ENV container=podman' \
  --change "LABEL sglang-deploy.recipe=$recipe" \
  - "$image" >/dev/null
echo "built $image"
