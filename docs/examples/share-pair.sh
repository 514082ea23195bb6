#!/usr/bin/env bash
# SPDX-License-Identifier: MIT
#
# The sharing example end to end:
#   1. publish-pattern leases SIZE, fills its pattern, publishes it under a
#      name of this run's own and exits, leaving the lease to the broker;
#   2. N attach-pattern processes attach it by the name at once (every second
#      one read-only), check every word and hold it until all have checked:
#      the first as NAME, the name in its own user's namespace, the others as
#      OWNER/NAME, as a consumer of another user must (OWNER this user's name,
#      or its uid);
#   3. after they all freed it, one more attaches it with a wrong seed and must
#      see WRONG words (the check is not vacuous, and the lease outlived its
#      holders); the same NAME under another owner must attach nothing (names
#      are per owner); then one attaches it read-only, checks it and
#      unpublishes it;
#   4. attaching by the name must then fail.
# With VMMCTL, `vmmctl list --all` is shown after 1, during 2 and after 3; its
# --json form (read with python3) must show the lease under its name, owned by
# this user, with no holder once the producer has exited, then exactly the N consumers, each read-only or not as it asked, and no
# lease under the name at the end.
#
#   share-pair.sh PUBLISH_PATTERN ATTACH_PATTERN [SIZE] [N] [VMMCTL]
#
# The broker is the one at $VMMBROKER_SOCKET (or the system's). Exit status 0
# when every step went as described.
set -uo pipefail
usage="usage: share-pair.sh PUBLISH_PATTERN ATTACH_PATTERN [SIZE] [N] [VMMCTL]"
publish=${1:?$usage}
attach=${2:?$usage}
size=${3:-64M}
n=${4:-3}
vmmctl=${5:-}
name=share-pair-$$-$RANDOM
# OWNER/NAME, as other users name the lease: OWNER the user name, or the uid when it has none the broker
# would read back as a user name (one that begins with a digit is taken for a uid)
uid=$(id -u)
owner=$(id -un 2>/dev/null) || owner=$uid
case "$owner" in [0-9]* | "") owner=$uid ;; esac
ref=$owner/$name
other_uid=$((uid == 4242 ? 4243 : 4242))  # a user that published nothing here

dir=$(mktemp -d) || exit 1
pids=()
# shellcheck disable=SC2317 # called by the trap
cleanup() {
        exec 3>&-
        for p in "${pids[@]}"; do kill "$p" 2>/dev/null; done
        rm -rf "$dir"
}
trap cleanup EXIT
status=0
fail() { echo "share-pair: $*" >&2; status=1; }

# The holders of the lease this user published as $name, from `vmmctl list --all --json` (which gives the
# bare name, in the namespace of the owner's uid): "PID[:ro] ..." ("" when none), or "gone" when no lease of
# this user has the name.
holders() {
        "$vmmctl" list --all --json | python3 -c '
import json, sys
leases = [l for l in json.load(sys.stdin)["leases"] if l.get("name") == sys.argv[1] and l["uid"] == int(sys.argv[2])]
print(" ".join("%d%s" % (h["pid"], ":ro" if h["readonly"] else "") for h in leases[0]["holders"])
      if leases else "gone")' "$name" "$uid"
}
if [ -n "$vmmctl" ] && ! command -v python3 >/dev/null; then
        echo "share-pair: no python3: checking the table of vmmctl list only" >&2
        json=
else
        json=$vmmctl
fi

echo "\$ publish-pattern $size $name"
"$publish" "$size" "$name" | tee "$dir/published"
[ "${PIPESTATUS[0]}" -eq 0 ] || { fail "publish-pattern failed"; exit 1; }
grep -Fq "attach it as \"$ref\"" "$dir/published" || fail "publish-pattern did not say others attach it as $ref"

if [ -n "$vmmctl" ]; then
        echo "\$ vmmctl list --all                       # the producer has exited"
        "$vmmctl" list --all | tee "$dir/list" || fail "vmmctl list --all failed"
        # OWNER/NAME, ready to paste into attach-pattern
        grep -Fq -- " $ref " "$dir/list" || fail "vmmctl list --all does not show $ref"
fi
if [ -n "$json" ]; then
        # The producer has exited (the shell waited for it), and the broker handles a holder's exit before any
        # request that comes after it: the lease has no holder now.
        h=$(holders) || h="(vmmctl list --all --json failed)"
        if [ -z "$h" ]; then
                echo "share-pair: the broker saw the producer exit; \"$name\" lives on with no holder"
        else
                fail "\"$name\" has holders \"$h\" after its producer exited (want none)"
        fi
fi

# The consumers hold their leases until the last writer of "hold" closes it:
# this script, on fd 3. Their output comes back through "progress" on fd 4,
# line by line. Both are opened read-write so that opening does not wait.
mkfifo "$dir/hold" "$dir/progress" || exit 1
exec 3<>"$dir/hold" 4<>"$dir/progress"
echo "\$ attach-pattern --hold $name, then $((n - 1)) x attach-pattern --hold $ref" \
        "      # at once, every second one --readonly"
for ((i = 0; i < n; i++)); do
        opts=(--hold)
        ((i % 2)) && opts+=(--readonly)
        # the owner's processes may name it either way; another user's must use OWNER/NAME
        if ((i == 0)); then which=$name; else which=$ref; fi
        "$attach" "${opts[@]}" "$which" <"$dir/hold" >"$dir/progress" 2>&1 3>&- 4>&- &
        pids+=($!)
done

# Wait until every consumer says it holds the lease, one fails, or (a failure guard) two minutes pass.
holding=0
while [ "$holding" -lt "$n" ]; do
        read -r -t 120 line <&4 || { fail "the consumers went silent"; break; }
        echo "$line"
        case "$line" in
        *"owned by"*) case "$line" in *"(uid $uid)"*) ;; *) fail "a consumer got a lease of another owner: $line" ;; esac ;;
        *"holding the lease"*) holding=$((holding + 1)) ;;
        *WRONG* | *cannot* | *failed*) fail "a consumer failed: $line"; break ;;
        esac
done

if [ "$holding" -eq "$n" ] && [ -n "$vmmctl" ]; then
        echo "\$ vmmctl list --all                       # while the $n consumers hold it"
        "$vmmctl" list --all | tee "$dir/list" || fail "vmmctl list --all failed"
        for p in "${pids[@]}"; do
                grep -Eq "[[:space:]]${p}[[:space:]]" "$dir/list" || fail "vmmctl list --all does not show pid $p"
        done
fi
if [ "$holding" -eq "$n" ] && [ -n "$json" ]; then
        want=$(for ((i = 0; i < n; i++)); do echo "${pids[$i]}$( ((i % 2)) && echo :ro)"; done | sort | xargs)
        got=$(holders | tr ' ' '\n' | sort | xargs) || got="(vmmctl list --all --json failed)"
        [ "$got" = "$want" ] || fail "the holders of \"$name\" are \"$got\", not the consumers \"$want\""
fi

exec 3>&-                       # the consumers see end of input: they free their holds and exit
for ((i = 0; i < n; i++)); do
        wait "${pids[$i]}" || fail "consumer $i (pid ${pids[$i]}) failed"
done
pids=()
while read -r -t 0 line <&4 && read -r line <&4; do echo "$line"; done   # what they printed at the end
exec 4>&-

echo "\$ attach-pattern --seed 0 $ref      # a wrong seed: must fail"
"$attach" --seed 0 "$ref" >"$dir/wrong" 2>&1 && fail "attach-pattern with a wrong seed passed"
head -n 5 "$dir/wrong"
grep -q "WRONG" "$dir/wrong" || fail "attach-pattern with a wrong seed did not find wrong words"

echo "\$ attach-pattern $other_uid/$name      # the same name of another owner: must fail"
"$attach" "$other_uid/$name" >"$dir/other" 2>&1 && fail "attach-pattern attached $other_uid/$name, which nobody published"
cat "$dir/other"
grep -q "cannot attach" "$dir/other" || fail "attaching $other_uid/$name did not fail to attach"

echo "\$ attach-pattern --readonly --unpublish $ref"
"$attach" --readonly --unpublish "$ref" || fail "the last consumer failed"

echo "\$ attach-pattern $ref                     # unpublished: must fail"
"$attach" "$ref" >"$dir/gone" 2>&1 && fail "attach-pattern attached an unpublished name"
cat "$dir/gone"
grep -q "cannot attach" "$dir/gone" || fail "attaching the unpublished name did not fail to attach"

if [ -n "$vmmctl" ]; then
        echo "\$ vmmctl list --all"
        "$vmmctl" list --all | tee "$dir/list" || fail "vmmctl list --all failed"
        grep -Fq -- "$name" "$dir/list" && fail "vmmctl list --all still shows $name"
fi
if [ -n "$json" ]; then
        h=$(holders) || h="(vmmctl list --all --json failed)"
        [ "$h" = gone ] || fail "a lease is still published as \"$name\" (holders \"$h\")"
fi
[ "$status" -eq 0 ] && echo "share-pair: OK: $n consumers and 2 more attached \"$ref\" after its producer exited"
exit $status
