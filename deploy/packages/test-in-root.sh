#!/usr/bin/env bash
# The part of deploy/packages/test.sh that runs as root in a fresh Debian bookworm container
# (no network): installs revision 1 of the .deb files (/packages/r1), checks the users,
# directories and units, puts in place the files the example configs name (/site: a CA and
# certificates made by the test), runs each service's --check-config as its own user, checks
# man devctl and the bash completion, upgrades to revision 2 (/packages/r2) over an edited
# config, copies the installed binaries to /installed, then removes and purges everything.
set -euo pipefail

fail() {
    printf 'error: %s\n' "$*" >&2
    exit 1
}
say() { printf '==> %s\n' "$*"; }

say "dpkg -i revision 1 into a fresh bookworm root"
dpkg -i /packages/r1/*.deb
for user in ongrid ongrid-gateway; do
    getent passwd "$user" >/dev/null || fail "no system user $user"
done
[[ "$(stat -c "%U %a" /var/lib/ongrid)" == "ongrid 750" ]] || fail "/var/lib/ongrid: $(stat -c "%U %a" /var/lib/ongrid)"
[[ "$(stat -c "%U %a" /var/lib/ongrid-gateway)" == "ongrid-gateway 750" ]] || fail "/var/lib/ongrid-gateway: $(stat -c "%U %a" /var/lib/ongrid-gateway)"
for unit in ongrid-manager ongrid-agent ongrid-gateway; do
    grep -q "^ExecStart=/usr/bin/$unit " "/lib/systemd/system/$unit.service" || fail "$unit.service does not start /usr/bin/$unit"
done

say "the files the example configs name, put in place as an admin would"
mkdir -p /etc/grid-security
cp -r /site/certificates /etc/grid-security/certificates
install -m 0640 -g ongrid /site/manager.crt /site/manager.key /etc/ongrid/
install -m 0600 /site/agent.crt /site/agent.key /etc/ongrid/
printf "node1 %s\n" "$(head -c 32 /dev/urandom | od -An -tx1 | tr -d " \n")" >/etc/ongrid/agent-tokens
head -c 32 /dev/urandom | od -An -tx1 | tr -d " \n" >/etc/ongrid/gateway-token
cut -d" " -f2 /etc/ongrid/agent-tokens >/etc/ongrid/node-token
# Manager, gateway and agent on one host here: the gateway token is the manager's and the
# gateway's to read.
chgrp ongrid /etc/ongrid/agent-tokens
chown ongrid:ongrid-gateway /etc/ongrid/gateway-token
chmod 0640 /etc/ongrid/agent-tokens /etc/ongrid/gateway-token
chmod 0600 /etc/ongrid/node-token
# What a GPU node has before ongrid, the NVIDIA driver's nvidia-smi and the iptables of Docker,
# as stand-ins: --check-config checks that the agent's config names programs that exist.
for program in /usr/bin/nvidia-smi /usr/sbin/iptables /usr/sbin/iptables-restore; do
    printf '#!/bin/sh\nexit 0\n' >"$program"
    chmod 0755 "$program"
done

say "--check-config of each service on its installed config, as its own user"
runuser -u ongrid -- ongrid-manager --config /etc/ongrid/manager.toml --check-config
ongrid-agent --config /etc/ongrid/agent.toml --check-config
runuser -u ongrid-gateway -- ongrid-gateway --config /etc/ongrid/gateway.toml --check-config

say "man devctl and the bash completion"
command -v devctl >/dev/null || fail "no devctl on PATH"
devctl completions bash | cmp -s - /usr/share/bash-completion/completions/devctl ||
    fail "the installed bash completion differs from devctl completions bash"
words="$(bash -c "source /usr/share/bash-completion/completions/devctl
    COMP_WORDS=(devctl ses); COMP_CWORD=1; COMP_LINE=\"devctl ses\"; COMP_POINT=10
    _devctl devctl ses devctl; printf \"%s \" \"\${COMPREPLY[@]}\"")"
[[ "$words" == *session* ]] || fail "devctl ses<TAB> completes to [$words], not session"
zcat /usr/share/man/man1/devctl-session-new.1.gz | grep "min\\\\-capability" >/dev/null ||
    fail "devctl-session-new.1 does not describe --min-capability"

say "edit a config, then upgrade to revision 2"
printf "\n# edited by the site admin\n" >>/etc/ongrid/manager.toml
dpkg -i /packages/r2/*.deb
grep -qx "# edited by the site admin" /etc/ongrid/manager.toml || fail "the upgrade overwrote the edited /etc/ongrid/manager.toml"
[[ "$(dpkg-query -W -f "\${Version}" ongrid-manager)" == *-2 ]] || fail "ongrid-manager is not at revision 2"
runuser -u ongrid -- ongrid-manager --config /etc/ongrid/manager.toml --check-config
cp /usr/bin/ongrid-manager /usr/bin/ongrid-agent /usr/bin/ongrid-gateway /usr/bin/devctl /installed/

say "remove, then purge"
dpkg -r ongrid-manager ongrid-agent ongrid-gateway devctl
[[ ! -e /usr/bin/ongrid-manager && ! -e /lib/systemd/system/ongrid-manager.service ]] || fail "dpkg -r left the binary or the unit"
[[ -e /etc/ongrid/manager.toml ]] || fail "dpkg -r removed the config (only a purge may)"
dpkg -P ongrid-manager ongrid-agent ongrid-gateway
[[ ! -e /etc/ongrid/manager.toml ]] || fail "dpkg -P left /etc/ongrid/manager.toml"
say "installed, checked, upgraded and removed in a fresh root"
