//! The real `nvidia-smi` backend (the one a site runs, built by `gpu::from_config`) against a
//! stand-in `nvidia-smi`: a shell script the test writes, answering from files of the state the
//! test names. Discovery, a GPU nvidia-smi cannot reach, a GPU that vanishes and returns, a hang
//! (killed at the timeout: every GPU unknown, never healthy), a failure naming no GPU, and a
//! fatal Xid in the kernel log. That a GPU which returns stays drained is the manager's part
//! (`session-manager/tests/api/nodes.rs`).

// Test helpers outside `#[test]` functions: a failed setup step should panic right there.
#![allow(clippy::unwrap_used)]

use std::os::unix::fs::PermissionsExt;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use ongrid_agent::gpu::nvidia_smi::GONE_REASON;
use ongrid_agent::gpu::{from_config, GpuBackend, GpuBackendConfig};
use ongrid_core::{GpuHealth, GpuInfo};

const QUERY: &str = include_str!("../fixtures/nvidia-smi/a100x2.query.csv");
const LIST: &str = include_str!("../fixtures/nvidia-smi/a100x2.list.txt");
const GONE_QUERY: &str = include_str!("../fixtures/nvidia-smi/a100x2-one-gone.query.csv");
const GONE_LIST: &str = include_str!("../fixtures/nvidia-smi/a100x2-one-gone.list.txt");
/// What nvidia-smi prints for GPU 1 of the fixture host (bus 0F) when it cannot reach it.
const LOST_LINE: &str =
    "Unable to determine the device handle for GPU 00000000:0F:00.0: Unknown Error";

/// A stand-in nvidia-smi whose answers are files in its directory: `<state>.query` and
/// `<state>.list` (with `<state>.query.status`, `<state>.list.status` for exit statuses), the
/// state named in `state`; the state `hang` never answers.
struct FakeNvidiaSmi {
    dir: tempfile::TempDir,
    script: PathBuf,
}

impl FakeNvidiaSmi {
    fn new() -> Self {
        let dir = tempfile::tempdir().unwrap();
        let script = dir.path().join("nvidia-smi");
        let body = format!(
            r#"#!/bin/sh
dir='{}'
state=$(cat "$dir/state")
if [ "$state" = hang ]; then exec sleep 600; fi
case "$1" in
  -L) name=list ;;
  --query-gpu=*) name=query ;;
  *) echo "unexpected arguments: $*" >&2; exit 99 ;;
esac
cat "$dir/$state.$name"
exit "$(cat "$dir/$state.$name.status" 2>/dev/null || echo 0)"
"#,
            dir.path().display()
        );
        std::fs::write(&script, body).unwrap();
        std::fs::set_permissions(&script, std::fs::Permissions::from_mode(0o755)).unwrap();
        let fake = Self { dir, script };
        fake.answer("ok", (QUERY, 0), (LIST, 0));
        fake.set("ok");
        // Another test's fork may still hold the new script open for writing (ETXTBSY) for a
        // moment: wait until it runs, so the backend's first discovery is not that accident.
        let deadline = Instant::now() + Duration::from_secs(10);
        while let Err(error) = std::process::Command::new(&fake.script).arg("-L").output() {
            assert!(
                error.raw_os_error() == Some(26) && Instant::now() < deadline,
                "{error}"
            );
            std::thread::yield_now();
        }
        fake
    }

    fn answer(&self, state: &str, query: (&str, i32), list: (&str, i32)) {
        let dir = self.dir.path();
        std::fs::write(dir.join(format!("{state}.query")), query.0).unwrap();
        std::fs::write(
            dir.join(format!("{state}.query.status")),
            query.1.to_string(),
        )
        .unwrap();
        std::fs::write(dir.join(format!("{state}.list")), list.0).unwrap();
        std::fs::write(dir.join(format!("{state}.list.status")), list.1.to_string()).unwrap();
    }

    fn set(&self, state: &str) {
        std::fs::write(self.dir.path().join("state"), state).unwrap();
    }

    fn kernel_log(&self) -> PathBuf {
        self.dir.path().join("kmsg")
    }

    /// The backend as the agent's config builds it.
    fn backend(&self, timeout: &str) -> Arc<dyn GpuBackend> {
        std::fs::write(self.kernel_log(), "").unwrap();
        from_config(&GpuBackendConfig::NvidiaSmi {
            path: Some(self.script.clone()),
            timeout: Some(timeout.to_owned()),
            kernel_log: Some(self.kernel_log()),
        })
        .unwrap()
    }
}

fn health(gpus: &[GpuInfo]) -> Vec<GpuHealth> {
    gpus.iter().map(|gpu| gpu.health.clone()).collect()
}

#[tokio::test]
async fn the_nvidia_smi_backend_judges_health_from_a_fake_nvidia_smi() {
    let smi = FakeNvidiaSmi::new();
    let backend = smi.backend("1 second");
    assert_eq!(backend.kind(), "nvidia-smi");

    // Discovery: both A100s, healthy, with what nvidia-smi says of them.
    let gpus = backend.discover().await.unwrap();
    assert_eq!(gpus.len(), 2);
    assert_eq!(gpus[0].model, "NVIDIA A100-SXM4-40GB");
    assert_eq!(gpus[1].pci_bus_id.as_deref(), Some("00000000:0F:00.0"));
    assert_eq!(health(&gpus), [GpuHealth::Healthy, GpuHealth::Healthy]);

    // nvidia-smi cannot reach GPU 1 (exit status 15) but answers for GPU 0: GPU 1 failed with
    // nvidia-smi's words, GPU 0 healthy.
    let one_row = QUERY.lines().next().unwrap();
    let one_line = LIST.lines().next().unwrap();
    smi.answer(
        "lost",
        (&format!("{one_row}\n{LOST_LINE}\n"), 15),
        (&format!("{one_line}\n{LOST_LINE}\n"), 15),
    );
    smi.set("lost");
    let gpus = backend.discover().await.unwrap();
    assert_eq!(
        health(&gpus),
        [
            GpuHealth::Healthy,
            GpuHealth::Failed(format!("nvidia-smi: {LOST_LINE}"))
        ]
    );

    // It returns: healthy again as far as the agent sees (the manager keeps it drained).
    smi.set("ok");
    let gpus = backend.discover().await.unwrap();
    assert_eq!(health(&gpus), [GpuHealth::Healthy, GpuHealth::Healthy]);

    // It vanishes from the list without a word: failed all the same.
    smi.answer("gone", (GONE_QUERY, 0), (GONE_LIST, 0));
    smi.set("gone");
    let gpus = backend.discover().await.unwrap();
    assert_eq!(gpus.len(), 2);
    assert_eq!(gpus[1].health, GpuHealth::Failed(GONE_REASON.to_owned()));

    // nvidia-smi hangs: killed at the timeout, and every GPU is unknown, never healthy.
    smi.set("hang");
    let started = Instant::now();
    let gpus = backend.discover().await.unwrap();
    assert!(
        started.elapsed() < Duration::from_secs(5),
        "{:?}",
        started.elapsed()
    );
    assert_eq!(gpus.len(), 2);
    for gpu in &gpus {
        let GpuHealth::Unknown(reason) = &gpu.health else {
            panic!("{gpu:?}");
        };
        assert!(
            reason.starts_with("nvidia-smi did not answer within 1 s and was killed"),
            "{reason}"
        );
    }

    // A failure that names no GPU (the driver is gone): unknown too, with nvidia-smi's words.
    smi.answer(
        "no-driver",
        (include_str!("../fixtures/nvidia-smi/no-driver.txt"), 9),
        ("", 9),
    );
    smi.set("no-driver");
    let gpus = backend.discover().await.unwrap();
    for gpu in &gpus {
        let GpuHealth::Unknown(reason) = &gpu.health else {
            panic!("{gpu:?}");
        };
        assert!(
            reason.contains("couldn't communicate with the NVIDIA driver")
                || reason.contains("NVIDIA-SMI has failed"),
            "{reason}"
        );
    }

    // A fatal Xid for GPU 0 (bus 07) in the kernel log: failed, though nvidia-smi lists it.
    smi.set("ok");
    std::fs::write(
        smi.kernel_log(),
        "6,1201,5000000,-;NVRM: Xid (PCI:0000:07:00): 79, pid=0, name=python, GPU has fallen off the bus.\n",
    )
    .unwrap();
    let gpus = backend.discover().await.unwrap();
    let GpuHealth::Failed(reason) = &gpus[0].health else {
        panic!("{:?}", gpus[0]);
    };
    assert!(reason.starts_with("Xid 79 at "), "{reason}");
    assert!(reason.ends_with(": GPU has fallen off the bus"), "{reason}");
    assert_eq!(gpus[1].health, GpuHealth::Healthy);
}

#[tokio::test]
async fn a_first_discovery_that_fails_is_an_error_saying_what_to_do() {
    let smi = FakeNvidiaSmi::new();
    smi.set("hang");
    let backend = smi.backend("1 second");
    let error = backend.discover().await.unwrap_err();
    assert!(
        error
            .to_string()
            .contains("did not finish within 1 s and was killed"),
        "{error}"
    );
}
