//! Real RDMA verbs without an RDMA NIC: the soft-RoCE VM harness
//! (`scripts/rxe-vm.sh`) boots Debian's stock kernel with `rdma_rxe`, and
//! these tests check, in one VM boot to keep CI time down, that rxe0 is
//! ACTIVE, that perftest's `ib_write_bw -R` moves 4 MiB messages over real
//! rdma_cm connections, and that kvsync's own verbs probe finds rxe0 there —
//! while on the host it finds nothing.

mod common;

use std::io::Write;

use common::*;

/// Everything checked inside the VM, section by section.
const VM_SCRIPT: &str = r#"
echo "== devinfo"
ibv_devinfo -d rxe0 | grep -E 'hca_id|state'
echo "== probe"
"$KVSYNC_BIN" probe --json
echo "== ib_write_bw"
ib_write_bw -R -d rxe0 -s 4194304 -n 40 -F > /tmp/server.log 2>&1 &
server=$!
ok=0
# The server needs a moment to listen; retry the client with a bound.
for attempt in $(seq 40); do
    if ib_write_bw -R -d rxe0 -s 4194304 -n 40 -F 10.0.2.15 > /tmp/client.log 2>&1; then ok=1; break; fi
    sleep 0.25
done
wait $server
cat /tmp/client.log
[ $ok = 1 ] || { echo "ib_write_bw client never connected"; cat /tmp/server.log; exit 1; }
echo "== done"
"#;

fn section<'a>(out: &'a str, name: &str) -> &'a str {
    let start = out
        .find(&format!("== {name}\n"))
        .unwrap_or_else(|| panic!("no section {name} in:\n{out}"));
    let rest = &out[start + name.len() + 4..];
    &rest[..rest.find("\n== ").map_or(rest.len(), |e| e + 1)]
}

#[test]
fn soft_roce_vm_has_active_rxe0_and_real_verbs() {
    let Some(run) = run_in_vm(
        &["bash", "-c", VM_SCRIPT],
        &[("KVSYNC_BIN", kvsync_bin())],
        170,
    ) else {
        return;
    };
    assert_eq!(
        run.code, 0,
        "VM run failed (code {}):\n{}\n{}",
        run.code, run.stdout, run.stderr
    );
    let out = &run.stdout;

    let devinfo = section(out, "devinfo");
    assert!(
        devinfo.contains("rxe0") && devinfo.contains("PORT_ACTIVE"),
        "{devinfo}"
    );

    let probe: serde_json::Value =
        serde_json::from_str(section(out, "probe").trim()).expect("probe JSON");
    assert_eq!(probe["rdma_available"], true, "{probe}");
    assert_eq!(probe["device"], "rxe0");
    assert_eq!(probe["devices"][0]["soft"], true);
    assert_eq!(probe["devices"][0]["ports"][0]["state"], "ACTIVE");

    // perftest's result line: bytes, iterations, BW peak, BW average, msg rate.
    let bw = section(out, "ib_write_bw");
    let line = bw
        .lines()
        .find(|l| l.trim_start().starts_with("4194304"))
        .unwrap_or_else(|| panic!("no 4 MiB result line in:\n{bw}"));
    let avg: f64 = line
        .split_whitespace()
        .nth(3)
        .and_then(|v| v.parse().ok())
        .expect("BW average");
    assert!(avg > 0.0, "{line}");
    let _ = writeln!(
        std::io::stderr(),
        "soft-RoCE ib_write_bw -R 4 MiB: {avg:.1} MB/s average (inside the VM, emulated CPU)"
    );
}

#[test]
fn host_probe_finds_no_rdma() {
    let out = std::process::Command::new(kvsync_bin())
        .args(["probe", "--json"])
        .output()
        .unwrap();
    assert!(out.status.success(), "probe exits 0 without RDMA");
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    if std::path::Path::new("/sys/class/infiniband").exists() {
        return; // a host with a real RDMA stack
    }
    assert_eq!(v["rdma_available"], false);
    assert_eq!(v["devices"], serde_json::json!([]));
    assert!(v["reason"].as_str().unwrap().starts_with("no RDMA"));
    let text = std::process::Command::new(kvsync_bin())
        .arg("probe")
        .output()
        .unwrap();
    assert!(String::from_utf8_lossy(&text.stdout).contains("would use: tcp"));
}
