//! What the store takes, built alike for the unit tests of every module: a SQLite store in a
//! temporary directory, GPUs, node registrations, nodes and GPUs as read, and new sessions.

use std::sync::Arc;

use chrono::{DateTime, Utc};
use ongrid_core::job::{JobId, JobImage, JobSpecFile};
use ongrid_core::{
    ComputeCapability, Dn, GpuHealth, GpuInfo, GpuRequest, GpuUuid, MemorySize, NodeName, SessionId,
};

use super::{GpuRecord, NewSession, NodeRecord, NodeRegistration, SqliteStore, UserRecord};
use crate::domain::grid_jobs::GridJob;
use crate::domain::jobs::{self, JobLimits, NewJob, Submitter};

/// A new SQLite store, in a temporary directory that must live as long as the store.
pub async fn sqlite() -> (tempfile::TempDir, Arc<SqliteStore>) {
    let dir = tempfile::tempdir().unwrap();
    let store = SqliteStore::open(&dir.path().join("m.db")).await.unwrap();
    (dir, Arc::new(store))
}

/// The migrations in `migrations` (a folder of the crate) older than `version`, copied into
/// `dir`/migrations: those of a database of an older release.
pub async fn migrations_before(
    migrations: &str,
    version: &str,
    dir: &std::path::Path,
) -> sqlx::migrate::Migrator {
    let old = dir.join("migrations");
    std::fs::create_dir(&old).unwrap();
    let all = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join(migrations);
    for entry in std::fs::read_dir(&all).unwrap() {
        let path = entry.unwrap().path();
        let name = path.file_name().unwrap().to_str().unwrap().to_owned();
        if name.as_str() < version {
            std::fs::copy(&path, old.join(&name)).unwrap();
        }
    }
    sqlx::migrate::Migrator::new(old.as_path()).await.unwrap()
}

/// A healthy A100 40 GB whose UUID ends in `n`, on PCI bus `n`.
pub fn gpu(n: u8) -> GpuInfo {
    GpuInfo {
        uuid: GpuUuid::parse(&format!("GPU-11111111-2222-3333-4444-5555555555{n:02}")).unwrap(),
        model: "NVIDIA A100-SXM4-40GB".to_owned(),
        capability: ComputeCapability::new(8, 0),
        memory: MemorySize::from_mib(40_960),
        pci_bus_id: Some(format!("00000000:{n:02}:00.0")),
        driver_version: Some("550.54.15".to_owned()),
        mig_enabled: false,
        health: GpuHealth::Healthy,
        utilization_percent: None,
        mig_devices: Vec::new(),
        mig_waiting: None,
    }
}

/// Node `name` registering, its agent on simulated GPUs.
pub fn registration(name: &str) -> NodeRegistration {
    NodeRegistration {
        name: NodeName::parse(name).unwrap(),
        gpu_backend: "simulated".to_owned(),
        agent_version: "0.1.0".to_owned(),
        stream_url: None,
        start_modes: Default::default(),
    }
}

/// Node `name` as the store reads it, registered from [`registration`], last seen at
/// `last_seen`, with `gpus` and no drain.
pub fn node_record(name: &str, last_seen: DateTime<Utc>, gpus: Vec<GpuRecord>) -> NodeRecord {
    let registered = registration(name);
    NodeRecord {
        name: registered.name,
        gpu_backend: registered.gpu_backend,
        agent_version: registered.agent_version,
        stream_url: registered.stream_url,
        last_seen,
        gpus: gpus.into(),
        drain: None,
    }
}

/// GPU [`gpu`]`(n)` of node `node` as the store reads it: exclusive, not drained.
pub fn gpu_record(node: &str, n: u8) -> GpuRecord {
    GpuRecord {
        node: NodeName::parse(node).unwrap(),
        info: gpu(n),
        mode: ongrid_core::GpuMode::Exclusive,
        drain: None,
    }
}

/// `user`'s job of `spec`, the image `model:v1` running `train`, submitted at `at` under the
/// default limits, to `grid` when given.
pub fn job(
    user: &UserRecord,
    spec: JobSpecFile,
    grid: Option<GridJob>,
    at: DateTime<Utc>,
) -> NewJob {
    let spec = JobSpecFile {
        image: Some("model:v1".into()),
        command: vec!["train".into()],
        ..spec
    }
    .validate(at)
    .unwrap();
    let image = JobImage {
        digest: format!("sha256:{}", "b".repeat(64)),
        docker_image: format!("ongrid/{}/model:v1", user.user_name),
    };
    let who = Submitter {
        owner: user.dn.clone(),
        user_name: user.user_name.clone(),
        uid: user.uid,
    };
    let id = JobId::new_random();
    jobs::submit(id, who, spec, image, &JobLimits::default(), grid, at).unwrap()
}

/// `owner`'s new session for one GPU of any kind, under the first free default name, asked
/// for at `at`.
pub fn new_session(owner: &Dn, at: DateTime<Utc>) -> NewSession {
    NewSession {
        id: SessionId::new_random(),
        name: None,
        owner: owner.clone(),
        request: GpuRequest::default(),
        image: "ongrid/dev:latest".to_owned(),
        at,
        reason: "created".to_owned(),
        idle_timeout_secs: None,
        max_duration_secs: None,
    }
}
