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
/// state named in `state`; the state `hang` never answers. MIG as the driver keeps it:
/// `-i GPU -mig 1` turns MIG mode on (file `migmode.GPU`: the query then says `Enabled`) and
/// `-mig 0` off again (a file `mig-off-pending` leaves it on, printing that file's warning),
/// `mig -i GPU -cgi P1,P2 -C` appends one device per profile to `mig.GPU` (listed under its
/// GPU by `-L`), `-dci` fails with "No compute instances found" when there are none, `-dgi`
/// removes them; a file `mig-fail` makes `-cgi` fail with its text. Every call is appended to
/// `calls`.
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
echo "$*" >> "$dir/calls"
status() {{ cat "$dir/$state.$1.status" 2>/dev/null || echo 0; }}
case "$1" in
  -L)
    while IFS= read -r line; do
      echo "$line"
      u=$(echo "$line" | sed -n 's/^GPU [0-9]*: .* (UUID: \(GPU-[^)]*\))$/\1/p')
      if [ -n "$u" ] && [ -f "$dir/mig.$u" ]; then cat "$dir/mig.$u"; fi
    done < "$dir/$state.list"
    exit "$(status list)" ;;
  --query-gpu=*)
    while IFS= read -r line; do
      u=${{line%%,*}}
      if [ -f "$dir/migmode.$u" ]; then echo "$line" | sed 's/, Disabled,/, Enabled,/'; else echo "$line"; fi
    done < "$dir/$state.query"
    exit "$(status query)" ;;
  -i)
    [ "$3" = -mig ] || {{ echo "unexpected arguments: $*" >&2; exit 99; }}
    if [ "$4" = 0 ]; then
      echo "Disabled MIG Mode for GPU $2"
      if [ -f "$dir/mig-off-pending" ]; then cat "$dir/mig-off-pending"; else rm -f "$dir/migmode.$2"; fi
      echo "All done."
    else
      touch "$dir/migmode.$2"; echo "Enabled MIG Mode for GPU $2"; echo "All done."
    fi ;;
  mig)
    u=$3
    case "$4" in
      -dci) [ -s "$dir/mig.$u" ] || {{ echo "No compute instances found: Not Found"; exit 6; }} ;;
      -dgi) [ -s "$dir/mig.$u" ] || {{ echo "No GPU instances found: Not Found"; exit 6; }}; rm -f "$dir/mig.$u" ;;
      -cgi)
        if [ -f "$dir/mig-fail" ]; then cat "$dir/mig-fail" >&2; exit 2; fi
        i=$(cat "$dir/mig.$u" 2>/dev/null | wc -l)
        for p in $(echo "$5" | tr , ' '); do
          echo "  MIG $p     Device  $i: (UUID: MIG-0000000$i-0000-4000-8000-${{u##*-}})" >> "$dir/mig.$u"
          echo "Successfully created GPU instance ID $i on GPU 0 using profile MIG $p (ID 9)"
          i=$((i+1))
        done ;;
      *) echo "unexpected arguments: $*" >&2; exit 99 ;;
    esac ;;
  *) echo "unexpected arguments: $*" >&2; exit 99 ;;
esac
exit 0
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

    /// The nvidia-smi calls made so far that changed MIG state, one per line.
    fn mig_calls(&self) -> Vec<String> {
        std::fs::read_to_string(self.dir.path().join("calls"))
            .unwrap_or_default()
            .lines()
            .filter(|l| l.starts_with("mig ") || l.contains(" -mig "))
            .map(str::to_owned)
            .collect()
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

#[tokio::test]
async fn a_mig_layout_is_made_with_nvidia_smi_only_once_nothing_uses_the_gpu() {
    use std::collections::BTreeMap;

    use ongrid_agent::gpu::mig::{MigLayouts, MigWanted};
    use ongrid_core::{GpuId, MigLayout};

    let smi = FakeNvidiaSmi::new();
    let backend = smi.backend("5 seconds");
    let gpus = backend.discover().await.unwrap();
    let gpu = gpus[0].clone();
    assert!(!gpu.mig_enabled && gpu.mig_devices.is_empty());
    let layout: MigLayout = "3g.20gb*1+2g.10gb*2".parse().unwrap();
    let layouts = BTreeMap::from([(gpu.uuid.clone(), layout)]);
    let mut mig = MigLayouts::default();

    let no_off = std::collections::BTreeSet::new();
    let only = |layouts| MigWanted {
        layouts,
        off: &no_off,
    };

    // A session holds the GPU: nothing is run.
    let held = [GpuId::Gpu(gpu.uuid.clone())];
    assert!(mig.apply(&*backend, only(&layouts), &gpus, &held).await);
    assert!(smi.mig_calls().is_empty(), "{:?}", smi.mig_calls());

    // Empty: MIG mode on, old instances destroyed (none), the layout created in its order.
    assert!(mig.apply(&*backend, only(&layouts), &gpus, &[]).await);
    let id = gpu.uuid.to_string();
    assert_eq!(
        smi.mig_calls(),
        [
            format!("-i {id} -mig 1"),
            format!("mig -i {id} -dci"),
            format!("mig -i {id} -dgi"),
            format!("mig -i {id} -cgi 3g.20gb,2g.10gb,2g.10gb -C"),
        ]
    );
    let mut gpus = backend.discover().await.unwrap();
    mig.mark(&mut gpus);
    assert!(gpus[0].mig_enabled);
    assert_eq!(gpus[0].health, GpuHealth::Healthy);
    let devices: Vec<(String, String)> = gpus[0]
        .mig_devices
        .iter()
        .map(|d| (d.profile.to_string(), d.parent.to_string()))
        .collect();
    assert_eq!(
        devices,
        [
            ("3g.20gb".to_owned(), id.clone()),
            ("2g.10gb".to_owned(), id.clone()),
            ("2g.10gb".to_owned(), id.clone()),
        ]
    );
    assert!(!gpus[1].mig_enabled, "the other GPU is left alone");

    // A new layout the driver refuses: the GPU is reported failed with nvidia-smi's words.
    std::fs::write(
        smi.dir.path().join("mig-fail"),
        "Unable to create a GPU instance on GPU 0 using profile 9: Insufficient Resources",
    )
    .unwrap();
    let seven = BTreeMap::from([(gpu.uuid.clone(), "1g.5gb*7".parse().unwrap())]);
    assert!(mig.apply(&*backend, only(&seven), &gpus, &[]).await);
    let mut gpus = backend.discover().await.unwrap();
    mig.mark(&mut gpus);
    let GpuHealth::Failed(reason) = &gpus[0].health else {
        panic!("{:?}", gpus[0].health);
    };
    assert!(
        reason.starts_with(&format!(
            "MIG layout 1g.5gb*7 could not be made: nvidia-smi mig -i {id} -cgi \
             1g.5gb,1g.5gb,1g.5gb,1g.5gb,1g.5gb,1g.5gb,1g.5gb -C: Unable to create a GPU \
             instance on GPU 0 using profile 9: Insufficient Resources"
        )),
        "{reason}"
    );
    assert!(
        gpus[0].mig_devices.is_empty(),
        "half made: the old devices are gone"
    );
}

#[tokio::test]
async fn leaving_mig_mode_with_nvidia_smi_waits_for_the_gpu_then_destroys_and_turns_it_off() {
    use std::collections::{BTreeMap, BTreeSet};

    use ongrid_agent::gpu::mig::{MigLayouts, MigWanted};
    use ongrid_core::{GpuId, MigChange, MigLayout};

    let smi = FakeNvidiaSmi::new();
    let backend = smi.backend("5 seconds");
    let gpus = backend.discover().await.unwrap();
    let id = gpus[0].uuid.to_string();
    let layout: MigLayout = "3g.20gb*1+2g.10gb*2".parse().unwrap();
    let layouts = BTreeMap::from([(gpus[0].uuid.clone(), layout)]);
    let no_off = BTreeSet::new();
    let mut mig = MigLayouts::default();
    let partition = MigWanted {
        layouts: &layouts,
        off: &no_off,
    };
    assert!(mig.apply(&*backend, partition, &gpus, &[]).await);
    let gpus = backend.discover().await.unwrap();
    assert_eq!(gpus[0].mig_devices.len(), 3);

    // Set back to exclusive while a job runs on one of its devices: nothing is run, and the
    // GPU says what it waits for.
    let calls_before = smi.mig_calls().len();
    let none = BTreeMap::new();
    let off = BTreeSet::from([gpus[0].uuid.clone()]);
    let leave = MigWanted {
        layouts: &none,
        off: &off,
    };
    let job = [GpuId::Mig(gpus[0].mig_devices[2].uuid.clone())];
    assert!(mig.apply(&*backend, leave, &gpus, &job).await);
    assert_eq!(smi.mig_calls().len(), calls_before, "{:?}", smi.mig_calls());
    let mut gpus = backend.discover().await.unwrap();
    mig.mark(&mut gpus);
    assert_eq!(gpus[0].mig_waiting, Some(MigChange::Off));

    // Empty: instances destroyed, then MIG mode off; a whole GPU again.
    assert!(mig.apply(&*backend, leave, &gpus, &[]).await);
    assert_eq!(
        smi.mig_calls()[calls_before..],
        [
            format!("mig -i {id} -dci"),
            format!("mig -i {id} -dgi"),
            format!("-i {id} -mig 0"),
        ]
    );
    let mut gpus = backend.discover().await.unwrap();
    mig.mark(&mut gpus);
    assert!(!gpus[0].mig_enabled);
    assert!(gpus[0].mig_devices.is_empty());
    assert_eq!(gpus[0].mig_waiting, None);
    assert_eq!(gpus[0].health, GpuHealth::Healthy);

    // Partitioned again, then the driver leaves MIG mode pending (a process holds the GPU):
    // the GPU is failed with nvidia-smi's words and what to do.
    assert!(mig.apply(&*backend, partition, &gpus, &[]).await);
    let gpus = backend.discover().await.unwrap();
    assert!(gpus[0].mig_enabled);
    std::fs::write(
        smi.dir.path().join("mig-off-pending"),
        "Warning: MIG mode is in pending disable state for GPU 00000000:07:00.0:In use by another client",
    )
    .unwrap();
    assert!(mig.apply(&*backend, leave, &gpus, &[]).await);
    let mut gpus = backend.discover().await.unwrap();
    mig.mark(&mut gpus);
    let GpuHealth::Failed(reason) = &gpus[0].health else {
        panic!("{:?}", gpus[0].health);
    };
    assert!(
        reason.starts_with(&format!(
            "MIG mode could not be turned off: nvidia-smi -i {id} -mig 0: Disabled MIG Mode for \
             GPU {id}\nWarning: MIG mode is in pending disable state"
        )),
        "{reason}"
    );
    assert!(
        reason.contains(&format!(
            "nvidia-smi -i {id} --gpu-reset, or reboot the node"
        )),
        "{reason}"
    );
}
