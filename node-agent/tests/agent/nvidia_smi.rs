//! The real `nvidia-smi` backend (the one a site runs, built by `gpu::from_config`) against a
//! stand-in `nvidia-smi` ([`FakeNvidiaSmi`]): a shell script the test writes, answering from
//! files of the state the test names. Discovery, a GPU nvidia-smi cannot reach, a GPU that
//! vanishes and returns, a hang (killed at the timeout: every GPU unknown, never healthy), a
//! failure naming no GPU, and a fatal Xid in the kernel log. That a GPU which returns stays drained is the manager's part
//! (`session-manager/tests/api/nodes.rs`).

// Test helpers outside `#[test]` functions: a failed setup step should panic right there.
#![allow(clippy::unwrap_used)]

use std::time::{Duration, Instant};

use ongrid_agent::gpu::nvidia_smi::GONE_REASON;
use ongrid_core::{GpuHealth, GpuInfo};

use crate::fake_nvidia_smi::{FakeNvidiaSmi, LIST, QUERY};

const GONE_QUERY: &str = include_str!("../fixtures/nvidia-smi/a100x2-one-gone.query.csv");
const GONE_LIST: &str = include_str!("../fixtures/nvidia-smi/a100x2-one-gone.list.txt");
/// What nvidia-smi prints for GPU 1 of the fixture host (bus 0F) when it cannot reach it.
const LOST_LINE: &str =
    "Unable to determine the device handle for GPU 00000000:0F:00.0: Unknown Error";

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
