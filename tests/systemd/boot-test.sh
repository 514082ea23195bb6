#!/usr/bin/env bash
# SPDX-License-Identifier: MIT
#
# The installed units under the real systemd: installs the build (`meson install --destdir`) into an overlay
# of this machine's / (tmpfs upper layer, so nothing of the host changes), boots that tree's systemd in a
# container (systemd-nspawn -b), and checks, on the simulated device, with clients holding leases that carry
# canaries: socket activation, READY=1 and STATUS=, the watchdog aborting a SIGSTOPped daemon, `systemctl
# restart` (and the host memory kept for parks), `kill -9` and `daemon-reexec` keeping every lease and canary,
# `systemctl stop` ending every lease, the `systemd-analyze security` score, and a daemon that cannot serve
# (no driver, no device, a bad configuration) ending failed with its reason after one start, a failure that
# may pass retried only within the start limit. Prints a table: check, result, detail.
#
#   boot-test.sh MESON BUILD_DIR SIMCUDA_LIB HOLDER BINDIR SBINDIR UNIT_DIR SYSUSERS_DIR LIBDIR SANITIZE
#
# Every wait polls its condition against a deadline. The container, its mounts and the scratch folder are
# removed on every exit (trap). Exits 77 (skipped), saying why, only when this machine cannot boot a
# container: not root, no systemd-nspawn (Debian: systemd-container), no overlayfs, no mount permission.
set -uo pipefail

meson=$1 build=$2 simcuda=$3 holder=$4 bindir=$5 sbindir=$6 unit_dir=$7 sysusers_dir=$8 libdir=$9 sanitize=${10}

skip() { echo "SKIP: $*"; exit 77; }
[ "$(id -u)" -eq 0 ] || skip "needs root to mount an overlay and boot a container (CI runs as root)"
command -v systemd-nspawn >/dev/null || skip "systemd-nspawn is not installed (Debian: apt-get install systemd-container)"
command -v nsenter >/dev/null || skip "nsenter is not installed (Debian: util-linux)"
[ -x /lib/systemd/systemd ] || [ -x /usr/lib/systemd/systemd ] || skip "no systemd on this machine to boot"
grep -qw overlay /proc/filesystems || modprobe overlay 2>/dev/null
grep -qw overlay /proc/filesystems || skip "the kernel has no overlayfs"

T0=$EPOCHREALTIME
name=vmmbroker-test-$$
machine=/var/lib/machines/$name
tmp=$(mktemp -d /tmp/vmmbroker-boot.XXXXXX)
nspawn_pid= leader= holder_fds=()
mounted_tmpfs=no mounted_overlay=no

cleanup() {
        local fd
        trap - EXIT INT TERM
        for fd in "${holder_fds[@]}"; do eval "exec $fd>&-"; done
        if [ -n "$nspawn_pid" ] && kill -0 "$nspawn_pid" 2>/dev/null; then
                # SIGRTMIN+4 asks the container's systemd to power off; then make sure.
                [ -n "$leader" ] && kill -s RTMIN+4 "$leader" 2>/dev/null
                timeout 20 tail --pid="$nspawn_pid" -f /dev/null 2>/dev/null || {
                        kill -KILL "$nspawn_pid" 2>/dev/null
                        [ -n "$leader" ] && kill -KILL "$leader" 2>/dev/null
                        timeout 10 tail --pid="$nspawn_pid" -f /dev/null 2>/dev/null
                }
        fi
        if [ $mounted_overlay = yes ]; then umount "$machine" 2>/dev/null || umount -l "$machine"; fi
        if [ $mounted_tmpfs = yes ]; then umount "$tmp/layer" 2>/dev/null || umount -l "$tmp/layer"; fi
        rmdir "$machine" 2>/dev/null
        rmdir "/run/systemd/nspawn/propagate/$name" 2>/dev/null
        rm -rf "$tmp"
}
trap cleanup EXIT
trap 'echo "interrupted"; exit 1' INT TERM

# --- The table
checks=() failures=0
record() {      # record CHECK ok|FAIL DETAIL
        checks+=("$(printf '%-44s %-4s %s' "$1" "$2" "$3")")
        [ "$2" = ok ] || failures=$((failures + 1))
        printf '%s: %-44s %s\n' "$2" "$1" "$3"
}
table() {
        echo
        printf '%-44s %-4s %s\n' CHECK RESULT DETAIL
        printf '%s\n' "${checks[@]}"
        echo
        echo "$(( ${#checks[@]} - failures )) of ${#checks[@]} checks passed in $(elapsed "$T0") s"
}
elapsed() { echo "$EPOCHREALTIME $1" | awk '{ printf "%.2f", $1 - $2 }'; }
fatal() {       # a check that the rest depends on failed: show what there is, end
        record "$1" FAIL "$2"
        if [ -n "$leader" ]; then
                echo "--- journal of vmmbroker.service and vmmbroker.socket (last 60 lines)"
                ct journalctl --no-pager -n 60 -u vmmbroker.service -u vmmbroker.socket
        fi
        echo "--- container console (last 30 lines)"
        tail -n 30 "$tmp/console.log" 2>/dev/null
        table
        exit 1
}

# poll TIMEOUT COMMAND...: runs COMMAND every 0.1 s until it succeeds (0) or TIMEOUT seconds passed (1).
# COMMAND's status 2 means it never will: poll returns 1 at once.
poll() {
        local deadline r
        deadline=$(echo "$EPOCHREALTIME $1" | awk '{ printf "%.3f", $1 + $2 }')
        shift
        while :; do
                "$@"
                r=$?
                [ $r -eq 0 ] && return 0
                [ $r -eq 2 ] && return 1
                awk -v now="$EPOCHREALTIME" -v d="$deadline" 'BEGIN { exit !(now > d) }' && return 1
                sleep 0.1
        done
}

# ct COMMAND...: runs COMMAND in the container (its namespaces, root and environment), at most
# $CT_TIMEOUT (60) s.
ct() {
        timeout "${CT_TIMEOUT:-60}" nsenter -t "$leader" -a -- /usr/bin/env -i \
                PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin LANG=C.UTF-8 \
                SYSTEMD_COLORS=0 SYSTEMD_PAGER= SYSTEMD_LOG_COLOR=0 VMMBROKER_RECONNECT_TIMEOUT=5 "$@"
}
prop() { ct systemctl show -p "$2" --value "$1"; }     # prop UNIT PROPERTY
state_is() { [ "$(prop vmmbroker.service ActiveState)/$(prop vmmbroker.service SubState)" = "$1" ]; }
running_other_than() {  # the service is running with a main process other than $1 (and READY=1 came)
        local pid
        pid=$(prop vmmbroker.service MainPID)
        [ -n "$pid" ] && [ "$pid" != 0 ] && [ "$pid" != "$1" ] && state_is active/running
}
journal_since() {       # the service's messages since $1 ($EPOCHREALTIME: the container's clock is this one)
        ct journalctl --no-pager -o cat --since="@$1" -u vmmbroker.service
}

# --- 1. The tree: / with a tmpfs on top, and the build installed into it.
mkdir -p "$tmp/layer" "$machine" || skip "cannot create $machine"
mount -t tmpfs -o mode=0755 tmpfs "$tmp/layer" 2>"$tmp/mount.err" || skip "cannot mount a tmpfs: $(cat "$tmp/mount.err")"
mounted_tmpfs=yes
mkdir -p "$tmp/layer/upper" "$tmp/layer/work"
mount -t overlay overlay -o "lowerdir=/,upperdir=$tmp/layer/upper,workdir=$tmp/layer/work" "$machine" \
        2>"$tmp/mount.err" || skip "cannot mount an overlay of /: $(cat "$tmp/mount.err")"
mounted_overlay=yes

if ! "$meson" install -C "$build" --no-rebuild --quiet --destdir "$machine" >"$tmp/install.log" 2>&1; then
        cat "$tmp/install.log"
        fatal "meson install --destdir (the container's /)" "failed"
fi
testdir=/usr/local/libexec/vmmbroker-test
mkdir -p "$machine$testdir"
cp "$simcuda" "$machine$testdir/libcuda.so.1" && cp "$holder" "$machine$testdir/canary-holder" ||
        fatal "copy the simulated driver and the holder" "failed"
# Units and sysusers.d where systemd looks, the library where ld.so looks, whatever the prefix.
case "$unit_dir" in
/etc/systemd/system | /usr/local/lib/systemd/system | /usr/lib/systemd/system | /lib/systemd/system) ;;
*) cp "$machine$unit_dir/vmmbroker.socket" "$machine$unit_dir/vmmbroker.service" "$machine/etc/systemd/system/" ;;
esac
case "$sysusers_dir" in
/etc/sysusers.d | /usr/local/lib/sysusers.d | /usr/lib/sysusers.d) ;;
*) mkdir -p "$machine/etc/sysusers.d" && cp "$machine$sysusers_dir/vmmbroker.conf" "$machine/etc/sysusers.d/" ;;
esac
echo "$libdir" >"$machine/etc/ld.so.conf.d/zz-vmmbroker-test.conf"
ldconfig -r "$machine" 2>/dev/null

# The simulated device for the service and every client; a 3 s watchdog. Sanitizer builds: a sanitizer's
# report aborts the daemon (and the test finds it in the journal); LeakSanitizer cannot stop the world
# under SystemCallFilter= (no ptrace), so leaks are left to the other tests.
dropins=$machine/etc/systemd/system/vmmbroker.service.d
mkdir -p "$dropins"
cat >"$dropins/50-test.conf" <<EOF
[Service]
Environment=VMMBROKER_LIBCUDA=$testdir/libcuda.so.1 SIMCUDA_MEMORY=1G
Environment=ASAN_OPTIONS=detect_leaks=0:abort_on_error=1 UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1
WatchdogSec=3s
EOF
# A boot of the least: sysinit (journald, sysusers, tmpfiles) and sockets, no services of the host's.
record "install into an overlay of /" ok "meson install --destdir; units in $unit_dir; $(elapsed "$T0") s"

# --- 2. Boot.
t=$EPOCHREALTIME
systemd-nspawn -q -D "$machine" -M "$name" --private-network --register=no --keep-unit --link-journal=no \
        --console=read-only -b systemd.unit=basic.target </dev/null >"$tmp/console.log" 2>&1 &
nspawn_pid=$!
find_leader() {
        local p
        kill -0 "$nspawn_pid" 2>/dev/null || return 2
        for p in $(pgrep -P "$nspawn_pid"); do
                [ "$(cat /proc/"$p"/comm 2>/dev/null)" = systemd ] && { leader=$p; return 0; }
        done
        return 1
}
poll 30 find_leader || fatal "boot systemd in a container" "no container init within 30 s (console below)"
booted() {
        local s
        s=$(ct systemctl is-system-running 2>/dev/null)
        [ "$s" = running ] || [ "$s" = degraded ]
}
poll 90 booted || fatal "boot systemd in a container" "not up within 90 s: $(ct systemctl is-system-running)"
record "boot systemd in a container" ok "$(ct systemctl --version | head -1 | cut -d' ' -f1-2), up in $(elapsed "$t") s ($(ct systemctl is-system-running))"

# --- 3. Socket activation.
ct id vmmbroker >/dev/null 2>&1 || fatal "sysusers.d created the user vmmbroker" "no user vmmbroker in the container"
ct systemctl start vmmbroker.socket || fatal "vmmbroker.socket starts" "$(ct systemctl status --no-pager vmmbroker.socket)"
before=$(prop vmmbroker.service ActiveState)
t=$EPOCHREALTIME
out=$(ct vmmctl status 2>&1)
rc=$?
took=$(elapsed "$t")
if [ $rc -eq 0 ] && [ "$before" = inactive ] && state_is active/running; then
        record "socket activation: first vmmctl status" ok "answered in $took s, the service was $before"
else
        fatal "socket activation: first vmmctl status" "exit $rc in $took s, service was $before, now $(prop vmmbroker.service ActiveState): $out"
fi

# --- 4. READY=1 and STATUS=.
# Type=notify: active/running only after READY=1; before, the service is "activating".
record "READY=1 (Type=notify, active/running)" ok "$(prop vmmbroker.service ActiveState)/$(prop vmmbroker.service SubState), MainPID $(prop vmmbroker.service MainPID)"
status_text() { [ -n "$(prop vmmbroker.service StatusText)" ]; }
if poll 5 status_text; then
        record "STATUS= (systemctl show -p StatusText)" ok "\"$(prop vmmbroker.service StatusText)\""
else
        record "STATUS= (systemctl show -p StatusText)" FAIL "empty"
fi

# --- 5. Holders: two clients, each holding a lease with its canary.
ids=()
start_holder() {        # start_holder N: runs holder N with its stdin on a FIFO this script holds open
        local n=$1 fd
        mkfifo "$tmp/holder$n.in"
        (
                # Only this script may hold the FIFOs' write ends: their end is the holders' signal to end.
                for fd in "${holder_fds[@]}"; do eval "exec $fd>&-"; done
                CT_TIMEOUT=900 ct VMMBROKER_LIBCUDA="$testdir/libcuda.so.1" "$testdir/canary-holder" 64M <"$tmp/holder$n.in" >"$tmp/holder$n.out" 2>&1
        ) &
        exec {fd}>"$tmp/holder$n.in"
        holder_fds+=("$fd")
        eval "holder${n}_fd=$fd"
}
holder_leased() {
        grep -q '^leased ' "$tmp/holder$1.out" && return 0
        grep -q '^canary-holder: ' "$tmp/holder$1.out" && return 2      # it gave up
        return 1
}
for n in 1 2; do
        start_holder $n
        poll 30 holder_leased $n || fatal "holder $n leases 64M" "$(cat "$tmp/holder$n.out")"
        ids+=("$(sed -n 's/^leased \([^ ]*\) .*/\1/p' "$tmp/holder$n.out")")
done
leases_listed() {       # every holder's lease is in vmmctl list --all
        local list id
        list=$(ct vmmctl list --all --no-legend 2>&1) || return 1
        for id in "${ids[@]}"; do grep -qF -- "$id" <<<"$list" || return 1; done
}
n_checks=0
canaries_intact() {     # asks every holder to re-read its lease; all must say intact
        local n line fd
        n_checks=$((n_checks + 1))
        for n in 1 2; do
                eval "fd=\$holder${n}_fd"
                echo check >&"$fd"
        done
        for n in 1 2; do
                poll 30 grep -q "^check $n_checks: " "$tmp/holder$n.out" || { echo "holder $n: no answer"; return 1; }
                line=$(grep "^check $n_checks: " "$tmp/holder$n.out")
                [ "$line" = "check $n_checks: intact" ] || { echo "holder $n: $line"; return 1; }
        done
}
check_kept() {          # check_kept WHAT DETAIL: leases listed and canaries intact
        local why
        if ! poll 10 leases_listed; then
                record "$1: leases kept" FAIL "vmmctl list --all lacks ${ids[*]}: $(ct vmmctl list --all 2>&1 | head -5)"
        else
                record "$1: leases kept" ok "vmmctl list --all shows ${#ids[@]} leases; $2"
        fi
        if why=$(canaries_intact); then
                record "$1: canaries intact" ok "each holder re-read its 64M"
        else
                record "$1: canaries intact" FAIL "$why"
        fi
}
if leases_listed && canaries_intact >/dev/null; then
        record "2 holders lease 64M with a canary" ok "leases ${ids[*]}"
else
        fatal "2 holders lease 64M with a canary" "$(ct vmmctl list --all 2>&1)"
fi
stored=$(prop vmmbroker.service NFileDescriptorStore)
if [ "${stored:-0}" -gt 1 ]; then
        record "fd store holds slabs and the table" ok "NFileDescriptorStore=$stored"
else
        record "fd store holds slabs and the table" FAIL "NFileDescriptorStore=$stored (FDSTORE= set? $(prop vmmbroker.service Environment))"
fi

# --- 6. The watchdog aborts a stopped daemon; Restart= brings it back with the leases.
pid=$(prop vmmbroker.service MainPID) restarts=$(prop vmmbroker.service NRestarts) c=$EPOCHREALTIME
t=$EPOCHREALTIME
ct kill -STOP "$pid"
if poll 60 running_other_than "$pid"; then
        if journal_since "$c" | grep -q 'Watchdog timeout'; then
                record "watchdog (3 s) aborts a SIGSTOPped daemon" ok "PID $pid -> $(prop vmmbroker.service MainPID) in $(elapsed "$t") s, NRestarts $restarts -> $(prop vmmbroker.service NRestarts)"
        else
                record "watchdog (3 s) aborts a SIGSTOPped daemon" FAIL "restarted, but no \"Watchdog timeout\" in the journal"
        fi
else
        fatal "watchdog (3 s) aborts a SIGSTOPped daemon" "not running again within 60 s: $(prop vmmbroker.service ActiveState)"
fi
check_kept "after the watchdog" "restarted in $(elapsed "$t") s"

# --- 7. systemctl restart, with host memory kept for parks: holder 1 parks and unparks its lease first, which
# leaves 64M of host memory zeroed and cached; the restart keeps it (stored as hcache-..., taken back).
metric() { ct vmmctl metrics 2>/dev/null | sed -n "s/^$1{device=\"0\"} //p"; }
host_cached_is() { [ "$(metric vmmbroker_device_host_cached_bytes)" = "$1" ]; }
echo park >&"$holder1_fd"
if ! poll 30 grep -q '^park 1: ' "$tmp/holder1.out" || ! grep -q '^park 1: intact' "$tmp/holder1.out"; then
        record "a park and unpark leave host memory cached" FAIL "$(grep '^park 1: ' "$tmp/holder1.out" || echo 'no answer')"
elif ! poll 30 host_cached_is 67108864; then
        record "a park and unpark leave host memory cached" FAIL "vmmbroker_device_host_cached_bytes $(metric vmmbroker_device_host_cached_bytes)"
else
        record "a park and unpark leave host memory cached" ok "canary intact; 64M of host memory cached"
fi
pid=$(prop vmmbroker.service MainPID)
t=$EPOCHREALTIME
ct systemctl restart vmmbroker.service
if running_other_than "$pid"; then
        record "systemctl restart" ok "PID $pid -> $(prop vmmbroker.service MainPID) in $(elapsed "$t") s"
else
        fatal "systemctl restart" "$(prop vmmbroker.service ActiveState)/$(prop vmmbroker.service SubState)"
fi
check_kept "after systemctl restart" "restarted in $(elapsed "$t") s"
kept=$(metric vmmbroker_device_host_slabs_kept_total)
if host_cached_is 67108864 && [ "$kept" = 1 ]; then
        record "after systemctl restart: host memory for parks kept" ok "64M cached, vmmbroker_device_host_slabs_kept_total $kept"
else
        record "after systemctl restart: host memory for parks kept" FAIL "vmmbroker_device_host_cached_bytes $(metric vmmbroker_device_host_cached_bytes), kept $kept; journal: $(journal_since "$t" | grep -E 'host slab|Kept' | head -3)"
fi

# --- 8. kill -9.
pid=$(prop vmmbroker.service MainPID) restarts=$(prop vmmbroker.service NRestarts)
t=$EPOCHREALTIME
ct kill -KILL "$pid"
if poll 30 running_other_than "$pid"; then
        record "kill -9 the daemon (Restart=on-failure)" ok "PID $pid -> $(prop vmmbroker.service MainPID) in $(elapsed "$t") s, NRestarts $restarts -> $(prop vmmbroker.service NRestarts)"
else
        fatal "kill -9 the daemon (Restart=on-failure)" "not running again within 30 s: $(prop vmmbroker.service ActiveState)"
fi
check_kept "after kill -9" "restarted in $(elapsed "$t") s"

# --- 9. daemon-reexec: the daemon goes on; systemd's store survives (a restart after it finds the leases).
pid=$(prop vmmbroker.service MainPID) stored=$(prop vmmbroker.service NFileDescriptorStore)
t=$EPOCHREALTIME
ct systemctl daemon-reexec
poll 30 booted
if [ "$(prop vmmbroker.service MainPID)" = "$pid" ] && state_is active/running &&
   [ "$(prop vmmbroker.service NFileDescriptorStore)" = "$stored" ]; then
        record "systemctl daemon-reexec" ok "in $(elapsed "$t") s; the daemon (PID $pid) ran on; NFileDescriptorStore=$stored kept"
else
        record "systemctl daemon-reexec" FAIL "MainPID $pid -> $(prop vmmbroker.service MainPID), NFileDescriptorStore $stored -> $(prop vmmbroker.service NFileDescriptorStore)"
fi
ct systemctl restart vmmbroker.service
check_kept "daemon-reexec, then restart" "the store systemd kept across its re-exec"

# --- 10. The hardening score, from the running manager.
ct systemd-analyze security --no-pager vmmbroker.service >"$tmp/security.log" 2>&1
score=$(sed -n 's/.*Overall exposure level for vmmbroker.service: *\([0-9.]*\).*/\1/p' "$tmp/security.log")
if [ -n "$score" ] && awk -v s="$score" 'BEGIN { exit !(s <= 0.8) }'; then
        record "systemd-analyze security vmmbroker.service" ok "exposure $score (docs/hardening.md: at most 0.8)"
else
        tail -n 5 "$tmp/security.log"
        record "systemd-analyze security vmmbroker.service" FAIL "exposure ${score:-unknown}, over 0.8"
fi

# --- 11. systemctl stop ends every lease.
t=$EPOCHREALTIME
ct systemctl stop vmmbroker.service 2>/dev/null
stored=$(prop vmmbroker.service NFileDescriptorStore)
if state_is inactive/dead && [ "$stored" = 0 ]; then
        record "systemctl stop" ok "inactive in $(elapsed "$t") s; NFileDescriptorStore=0"
else
        record "systemctl stop" FAIL "$(prop vmmbroker.service ActiveState)/$(prop vmmbroker.service SubState), NFileDescriptorStore=$stored"
fi
list=$(ct vmmctl list --all --no-legend 2>&1)          # starts the service again, through the socket
left=0
for id in "${ids[@]}"; do grep -qF -- "$id" <<<"$list" && left=$((left + 1)); done
if [ $left -eq 0 ] && state_is active/running; then
        record "after stop: every lease ended" ok "the next start lists none of ${ids[*]}"
else
        record "after stop: every lease ended" FAIL "$left lease(s) still listed: $list"
fi
why=$(canaries_intact) && record "after stop: holders' mappings untouched" ok "each holder re-read its 64M" ||
        record "after stop: holders' mappings untouched" FAIL "$why"
for fd in "${holder_fds[@]}"; do eval "exec $fd>&-"; done
holder_fds=()
holders_done() { grep -q '^done' "$tmp/holder1.out" && grep -q '^done' "$tmp/holder2.out"; }
poll 30 holders_done || record "holders exit" FAIL "$(tail -n 2 "$tmp/holder1.out" "$tmp/holder2.out")"

# --- 12. A daemon that cannot serve: failed with its reason, after one start, the socket still listening.
# fail_case NAME DROP-IN EXPECTED_STATUS REASON_TEXT
fail_case() {
        local what=$1 dropin=$2 status=$3 reason=$4 c t rc took text starts
        ct systemctl stop vmmbroker.service 2>/dev/null
        printf '%s\n' "$dropin" >"$dropins/90-fail.conf"
        ct systemctl daemon-reload
        ct systemctl reset-failed vmmbroker.service vmmbroker.socket
        ct systemctl start vmmbroker.socket
        c=$EPOCHREALTIME
        t=$EPOCHREALTIME
        ct vmmctl status >"$tmp/vmmctl.out" 2>&1
        rc=$? took=$(elapsed "$t")
        if ! poll 30 state_is failed/failed; then
                record "$what" FAIL "not failed within 30 s: $(prop vmmbroker.service ActiveState)/$(prop vmmbroker.service SubState)"
                return
        fi
        # No new start for 2 RestartSec= after the failure (a restart would show as activating or active).
        if poll 5 eval '! state_is failed/failed'; then
                record "$what" FAIL "started again: $(prop vmmbroker.service ActiveState), NRestarts $(prop vmmbroker.service NRestarts)"
                return
        fi
        starts=$(journal_since "$c" | grep -c '^Starting vmmbroker')
        text=$(prop vmmbroker.service StatusText)
        echo "--- $what: systemctl status vmmbroker (what an administrator sees)"
        ct systemctl status --no-pager --lines=4 vmmbroker.service | sed 's/^/    /'
        echo "--- vmmctl status"
        sed 's/^/    /' "$tmp/vmmctl.out"
        local got="status $(prop vmmbroker.service ExecMainStatus), Result=$(prop vmmbroker.service Result), NRestarts=$(prop vmmbroker.service NRestarts), $starts start(s), socket $(prop vmmbroker.socket ActiveState); vmmctl exit $rc in $took s"
        if [ "$(prop vmmbroker.service ExecMainStatus)" = "$status" ] && [ "$(prop vmmbroker.service NRestarts)" = 0 ] &&
           [ "$starts" = 1 ] && [ "$(prop vmmbroker.socket ActiveState)" = active ] && [ $rc -ne 0 ] &&
           grep -qF -- "$reason" <<<"$text" && journal_since "$c" | grep -qF -- "$reason" &&
           awk -v s="$took" 'BEGIN { exit !(s < 10) }'; then
                record "$what" ok "$got"
                record "  its reason in StatusText" ok "\"${text:0:100}...\""
        else
                record "$what" FAIL "$got; StatusText \"$text\"; vmmctl: $(head -c 300 "$tmp/vmmctl.out")"
        fi
}
fail_case "no driver: failed, not restarted" \
        $'[Service]\nEnvironment=VMMBROKER_LIBCUDA=/nonexistent/libcuda.so.1' 6 "No CUDA driver"
fail_case "no device: failed, not restarted" \
        $'[Service]\nEnvironment=SIMCUDA_DEVICES=0' 6 "No CUDA device"
fail_case "bad configuration: failed, not restarted" \
        "$(printf '[Service]\nExecStart=\nExecStart=%s/vmmbrokerd --max-slab 3M' "$sbindir")" 2 "MaxSlab=3M"

# A failure that may pass (exit 1: here the simulated driver failing cuStreamCreate at every start) is
# retried every RestartSec=, until the start limit stops it; the socket then stops listening.
ct systemctl stop vmmbroker.service 2>/dev/null
printf '[Service]\nEnvironment=SIMCUDA_FAIL=cuStreamCreate:1\n' >"$dropins/90-fail.conf"
ct systemctl daemon-reload
ct systemctl reset-failed vmmbroker.service vmmbroker.socket
ct systemctl start vmmbroker.socket
c=$EPOCHREALTIME
t=$EPOCHREALTIME
ct vmmctl status >"$tmp/vmmctl.out" 2>&1
if poll 90 state_is failed/failed; then
        starts=$(journal_since "$c" | grep -c '^Starting vmmbroker')
        got="$starts starts, NRestarts=$(prop vmmbroker.service NRestarts), Result=$(prop vmmbroker.service Result), socket $(prop vmmbroker.socket ActiveState) ($(prop vmmbroker.socket Result)) after $(elapsed "$t") s"
        # Result= keeps the first failure (exit-code); the socket's says why it stopped listening.
        if [ "$(prop vmmbroker.socket Result)" = service-start-limit-hit ] && [ "$starts" -ge 2 ] &&
           [ "$starts" -le 10 ] && [ "$(prop vmmbroker.socket ActiveState)" = failed ]; then
                record "failure that may pass: retried, bounded" ok "$got"
        else
                record "failure that may pass: retried, bounded" FAIL "$got"
        fi
else
        record "failure that may pass: retried, bounded" FAIL "not failed within 90 s: $(prop vmmbroker.service ActiveState), NRestarts=$(prop vmmbroker.service NRestarts)"
fi
rm -f "$dropins/90-fail.conf"

# --- 13. Sanitizers: any report in the daemon's messages.
if [ -n "$sanitize" ] && [ "$sanitize" != none ]; then
        reports=$(ct journalctl --no-pager -o cat -u vmmbroker.service | grep -cE 'AddressSanitizer|runtime error:|UndefinedBehaviorSanitizer')
        [ "$reports" = 0 ] && record "sanitizers ($sanitize): no report" ok "in the daemon's journal" ||
                record "sanitizers ($sanitize): no report" FAIL "$reports report line(s): journalctl -u vmmbroker"
fi

table
[ $failures -eq 0 ]
