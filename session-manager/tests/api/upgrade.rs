//! Operations on the store as deploy/README.md tells an admin to do them: upgrading a database
//! made by the previous release (its migrations only, rows written as it wrote them) by opening
//! it with this one, and an online backup with `sqlite3 .backup` while the manager writes,
//! restored by putting the file back.

use std::path::{Path, PathBuf};

use chrono::{DateTime, SecondsFormat, TimeDelta, Utc};
use ongrid_core::job::{JobReason, JobSpecFile, JobState};
use ongrid_core::{
    ComputeCapability, Dn, GpuHealth, GpuInfo, GpuRequest, GpuUuid, MemorySize, NodeName,
    SessionId, SessionState,
};
use ongrid_manager::store::sqlite::SqliteStore;
use ongrid_manager::store::{AuditFilter, ImageFilter, JobFilter, SessionFilter, Store};

/// The last migration of the previous release: the schema an upgrading site has. Migrations
/// after it (this release's) run on top of it, whatever they are.
const PREVIOUS_RELEASE_LAST_MIGRATION: u32 = 15;

fn at(minutes: i64) -> DateTime<Utc> {
    DateTime::parse_from_rfc3339("2026-10-01T08:00:00Z")
        .unwrap()
        .with_timezone(&Utc)
        + TimeDelta::minutes(minutes)
}

/// Times as the store writes them.
fn text(time: DateTime<Utc>) -> String {
    time.to_rfc3339_opts(SecondsFormat::Nanos, true)
}

/// The migration files up to `last`, copied into `dir`.
fn migrations_up_to(last: u32, dir: &Path) -> PathBuf {
    let old = dir.join("migrations");
    std::fs::create_dir(&old).unwrap();
    let all = Path::new(env!("CARGO_MANIFEST_DIR")).join("migrations");
    let mut copied = 0;
    for entry in std::fs::read_dir(&all).unwrap() {
        let path = entry.unwrap().path();
        let name = path.file_name().unwrap().to_str().unwrap().to_owned();
        let version: u32 = name.split('_').next().unwrap().parse().unwrap();
        if version <= last {
            std::fs::copy(&path, old.join(&name)).unwrap();
            copied += 1;
        }
    }
    assert_eq!(copied, 13, "the previous release had 13 migrations");
    old
}

fn gpu() -> GpuInfo {
    GpuInfo {
        uuid: GpuUuid::parse("GPU-11111111-2222-3333-4444-555555555501").unwrap(),
        model: "NVIDIA A100-SXM4-40GB".to_owned(),
        capability: ComputeCapability::new(8, 0),
        memory: MemorySize::from_mib(40_960),
        pci_bus_id: Some("00000000:01:00.0".to_owned()),
        driver_version: Some("550.54.15".to_owned()),
        mig_enabled: false,
        health: GpuHealth::Healthy,
        utilization_percent: None,
        mig_devices: Vec::new(),
        mig_waiting: None,
    }
}

struct OldSite {
    alice: Dn,
    held: SessionId,
    running: SessionId,
    image: uuid::Uuid,
    job: uuid::Uuid,
}

/// Writes a site's worth of rows with the previous release's schema, as it wrote them.
async fn fill_previous_release(pool: &sqlx::SqlitePool) -> OldSite {
    let site = OldSite {
        alice: Dn::parse("/DC=org/DC=example/CN=Alice Smith").unwrap(),
        held: SessionId::new_random(),
        running: SessionId::new_random(),
        image: uuid::Uuid::new_v4(),
        job: uuid::Uuid::new_v4(),
    };
    let alice = site.alice.to_string();
    let (held, running, image, job) = (site.held, site.running, site.image, site.job);
    let request = serde_json::to_string(&GpuRequest::default()).unwrap();
    let gpu = gpu();
    let gpu_json = serde_json::to_string(&gpu).unwrap();
    let gpu_id = serde_json::to_string(&vec![gpu.uuid.to_string()]).unwrap();
    let spec = JobSpecFile::from_toml(
        "image = \"mymodel:v1\"\ncommand = [\"python\", \"train.py\"]\nrestartable = true\n",
    )
    .unwrap()
    .validate(at(0))
    .unwrap();
    let spec = serde_json::to_string(&spec).unwrap();
    let submitted = serde_json::to_string(&JobReason::Submitted).unwrap();
    let started = serde_json::to_string(&JobReason::Started {
        node: NodeName::parse("node1").unwrap(),
        gpus: vec![ongrid_core::GpuId::parse(&gpu.uuid.to_string()).unwrap()],
    })
    .unwrap();
    let digest = format!("sha256:{}", "ab".repeat(32));
    let t = |m| text(at(m));
    let statements = [
        format!(
            "INSERT INTO users (dn, user_name, uid, created_at) VALUES ('{alice}', 'alice-smith', 20000, '{}')",
            t(0)
        ),
        format!(
            "INSERT INTO user_events (dn, seq, at, action, by, details) VALUES \
             ('{alice}', 0, '{}', 'restored', 'admin', 'back from leave')",
            t(1)
        ),
        format!(
            "INSERT INTO ssh_keys (fingerprint, owner, algorithm, public_key, comment, added_at, expires_at) \
             VALUES ('SHA256:abc', '{alice}', 'ssh-ed25519', 'ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIA', \
             'alice@laptop', '{}', '{}')",
            t(0),
            t(60 * 24 * 365)
        ),
        format!(
            "INSERT INTO institutes (name, cidrs, created_at) VALUES ('uni', '[\"192.0.2.0/24\",\"2001:db8::/32\"]', '{}')",
            t(0)
        ),
        format!(
            "INSERT INTO nodes (name, gpu_backend, agent_version, registered_at, last_seen, stream_url) \
             VALUES ('node1', 'nvidia-smi', '0.1.0', '{}', '{}', 'wss://node1.example.org:8444')",
            t(0),
            t(30)
        ),
        format!(
            "INSERT INTO gpus (uuid, node, info, mode, updated_at) VALUES ('{}', 'node1', '{gpu_json}', 'shared:2', '{}')",
            gpu.uuid,
            t(30)
        ),
        format!(
            "INSERT INTO sessions (id, name, owner, request, image, state, reason, hold_reason, node, gpus, created_at, queued_at, preferred_node) VALUES \
             ('{held}', 'dev', '{alice}', '{request}', 'ongrid/dev:latest', 'HELD', 'no activity for 2 hours', 'idle', 'node1', '[]', '{0}', '{0}', 'node1'), \
             ('{running}', 'train1', '{alice}', '{request}', 'ongrid/dev:latest', 'CONNECTED', 'an SSH connection opened', NULL, 'node1', '{gpu_id}', '{0}', '{0}', NULL)",
            t(0)
        ),
        format!(
            "INSERT INTO session_transitions (session_id, seq, from_state, to_state, at, reason, hold_reason, repeats) VALUES \
             ('{held}', 0, NULL, 'PENDING', '{0}', 'created', NULL, 0), \
             ('{held}', 1, 'PENDING', 'STARTING', '{0}', 'placed', NULL, 0), \
             ('{held}', 2, 'STARTING', 'WAITING', '{0}', 'running', NULL, 0), \
             ('{held}', 3, 'WAITING', 'HELD', '{1}', 'no activity for 2 hours', 'idle', 0), \
             ('{running}', 0, NULL, 'PENDING', '{0}', 'created', NULL, 0), \
             ('{running}', 1, 'PENDING', 'STARTING', '{0}', 'placed', NULL, 0), \
             ('{running}', 2, 'STARTING', 'WAITING', '{0}', 'running', NULL, 0), \
             ('{running}', 3, 'WAITING', 'CONNECTED', '{0}', 'an SSH connection opened', NULL, 4)",
            t(0),
            t(120)
        ),
        format!(
            "INSERT INTO session_lifecycle (session_id, first_started_at, ready_at) VALUES ('{running}', '{0}', '{0}')",
            t(1)
        ),
        format!(
            "INSERT INTO connections (id, owner, fingerprint, source, institute, session_id, opened_at, closed_at, bytes_in, bytes_out, last_report_at, close_reason) VALUES \
             ('{}', '{alice}', 'SHA256:abc', '192.0.2.7', 'uni', '{running}', '{}', '{}', 1200, 34000, '{}', 'client closed')",
            uuid::Uuid::new_v4(),
            t(2),
            t(50),
            t(50)
        ),
        format!(
            "INSERT INTO images (id, owner, name, version, state, reason, session_id, session_name, node, base_image, compression, digest, size, sif_path, docker_image, bytes_done, bytes_total, progress_at, created_at, finished_at, shared_at) VALUES \
             ('{image}', '{alice}', 'mymodel', 'v1', 'READY', 'frozen', '{running}', 'train1', 'node1', 'ongrid/dev:latest', 'gzip', '{digest}', 1048576, '/var/lib/ongrid/images/sha256/{hex}.sif', 'ongrid/alice-smith/mymodel:v1', 1048576, 1048576, '{0}', '{0}', '{0}', '{1}')",
            t(10),
            t(11),
            hex = "ab".repeat(32)
        ),
        format!(
            "INSERT INTO jobs (id, owner, state, spec, max_duration_secs, image_digest, docker_image, node, gpus, chain_initial, restart_count, log_size, log_complete, queued_at, pinned_node) VALUES \
             ('{job}', '{alice}', 'RUNNING', '{spec}', 28800, '{digest}', 'ongrid/alice-smith/mymodel:v1', 'node1', '{gpu_id}', '{job}', 0, 2048, 0, '{}', 'node1')",
            t(12)
        ),
        format!(
            "INSERT INTO job_transitions (job_id, seq, from_state, to_state, at, reason) VALUES \
             ('{job}', 0, NULL, 'QUEUED', '{}', '{submitted}'), ('{job}', 1, 'QUEUED', 'RUNNING', '{}', '{started}')",
            t(12),
            t(13)
        ),
        format!(
            "INSERT INTO usage_accounts (user_dn, accounting_group, usage, updated_at) VALUES ('{alice}', 'atlas', 3.5, '{}')",
            t(60)
        ),
    ];
    for statement in statements {
        sqlx::query(&statement)
            .execute(pool)
            .await
            .unwrap_or_else(|e| panic!("{statement}: {e}"));
    }
    site
}

/// Everything the previous release stored reads back through this release's store.
async fn assert_site_survived(store: &SqliteStore, site: &OldSite) {
    let users = store.users().await.unwrap();
    assert_eq!(users.len(), 1);
    assert_eq!(
        (users[0].user_name.as_str(), users[0].uid),
        ("alice-smith", 20000)
    );
    assert!(users[0].removed.is_none());
    let keys = store.keys(None).await.unwrap();
    assert_eq!(keys.len(), 1);
    assert_eq!(keys[0].fingerprint, "SHA256:abc");
    assert_eq!(keys[0].expires_at, at(60 * 24 * 365));
    let institutes = store.institutes().await.unwrap();
    assert_eq!(institutes.len(), 1);
    assert_eq!(institutes[0].name.to_string(), "uni");
    let nodes = store.nodes().await.unwrap();
    assert_eq!(nodes.len(), 1);
    assert_eq!(
        nodes[0].stream_url.as_deref(),
        Some("wss://node1.example.org:8444")
    );
    assert_eq!(nodes[0].gpus.len(), 1);
    assert_eq!(nodes[0].gpus[0].info, gpu());
    assert_eq!(nodes[0].gpus[0].mode.to_string(), "shared:2");

    let held = store.session(site.held).await.unwrap().unwrap();
    assert_eq!(held.state, SessionState::Held);
    assert_eq!(held.reason, "idle: no activity for 2 hours");
    assert_eq!(store.transitions(site.held).await.unwrap().len(), 4);
    let running = store.session(site.running).await.unwrap().unwrap();
    assert_eq!(running.state, SessionState::Connected);
    assert_eq!(running.gpus.len(), 1);
    assert_eq!(store.sessions(SessionFilter::All).await.unwrap().len(), 2);
    let audit = store
        .audit(AuditFilter {
            owner: None,
            since: None,
            limit: 10,
        })
        .await
        .unwrap();
    assert_eq!(audit.len(), 1);
    assert_eq!(audit[0].bytes_in, 1200);

    let image = store.image(site.image).await.unwrap().unwrap();
    assert_eq!(image.reference.to_string(), "mymodel:v1");
    assert_eq!(image.shared_at, Some(at(11)));
    assert_eq!(store.images(ImageFilter::All).await.unwrap().len(), 1);
    let job = store
        .job(ongrid_core::job::JobId(site.job))
        .await
        .unwrap()
        .unwrap();
    assert_eq!(job.state(), JobState::Running);
    assert_eq!(job.pinned_node.as_ref().map(|n| n.as_str()), Some("node1"));
    assert_eq!(job.log_size, 2048);
    assert!(job.spec.restartable);
    assert_eq!(store.jobs(JobFilter::Active).await.unwrap().len(), 1);
    let accounts = store.usage_accounts().await.unwrap();
    assert_eq!(accounts.len(), 1);
}

#[tokio::test]
async fn a_database_of_the_previous_release_upgrades_with_its_data() {
    let dir = tempfile::tempdir().unwrap();
    let old = migrations_up_to(PREVIOUS_RELEASE_LAST_MIGRATION, dir.path());
    let file = dir.path().join("manager.db");
    let options = sqlx::sqlite::SqliteConnectOptions::new()
        .filename(&file)
        .create_if_missing(true)
        .foreign_keys(true);
    let pool = sqlx::SqlitePool::connect_with(options).await.unwrap();
    sqlx::migrate::Migrator::new(old.as_path())
        .await
        .unwrap()
        .run(&pool)
        .await
        .unwrap();
    let site = fill_previous_release(&pool).await;
    pool.close().await;

    // This release opens it: its own migrations run, and everything reads back.
    let store = SqliteStore::open(&file).await.unwrap();
    assert_site_survived(&store, &site).await;
    let applied: Vec<i64> = {
        let pool = sqlx::SqlitePool::connect(&format!("sqlite:{}", file.display()))
            .await
            .unwrap();
        let versions = sqlx::query_scalar(
            "SELECT version FROM _sqlx_migrations WHERE success ORDER BY version",
        )
        .fetch_all(&pool)
        .await
        .unwrap();
        pool.close().await;
        versions
    };
    // The previous release's migrations stay applied, and this release's ran on top of them.
    let previous: Vec<i64> = vec![1, 2, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 15];
    assert_eq!(applied[..previous.len()], previous[..], "{applied:?}");
    assert!(
        applied.len() > previous.len(),
        "no migration of this release ran: {applied:?}"
    );

    // And the upgraded database takes this release's writes.
    let bob = Dn::parse("/DC=org/DC=example/CN=Bob Jones").unwrap();
    let bob = store.user(&bob, 20000).await.unwrap();
    assert_eq!(bob.uid, 20001, "UIDs continue after the old ones");
    store.close().await;
    // Opening it again changes nothing.
    let store = SqliteStore::open(&file).await.unwrap();
    assert_site_survived_with_bob(&store, &site).await;
}

async fn assert_site_survived_with_bob(store: &SqliteStore, site: &OldSite) {
    let users = store.users().await.unwrap();
    assert_eq!(users.len(), 2);
    assert!(store.session(site.held).await.unwrap().is_some());
}

/// `sqlite3 DB ".backup FILE"` while the manager's store is open and has written (part of it
/// still in the WAL), then the restore of deploy/README.md: stop, put the file back without
/// the old WAL, start.
#[tokio::test]
async fn an_online_backup_restores_what_was_written_before_it() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("manager.db");
    let store = SqliteStore::open(&file).await.unwrap();
    let alice = Dn::parse("/DC=org/DC=example/CN=Alice Smith").unwrap();
    let bob = Dn::parse("/DC=org/DC=example/CN=Bob Jones").unwrap();
    store.user(&alice, 20000).await.unwrap();
    assert!(
        dir.path().join("manager.db-wal").exists(),
        "the write is in the WAL, not yet in the main file"
    );

    let backup = dir.path().join("manager-backup.db");
    let output = std::process::Command::new("sqlite3")
        .arg(&file)
        .arg(format!(".backup '{}'", backup.display()))
        .output()
        .expect("sqlite3 must be installed (deploy/debian-packages.txt)");
    assert!(
        output.status.success(),
        "sqlite3 .backup: {}",
        String::from_utf8_lossy(&output.stderr)
    );
    let check = std::process::Command::new("sqlite3")
        .arg(&backup)
        .arg("PRAGMA integrity_check")
        .output()
        .unwrap();
    assert_eq!(String::from_utf8_lossy(&check.stdout).trim(), "ok");

    // Written after the backup: lost by the restore, as it should be.
    store.user(&bob, 20000).await.unwrap();
    store.close().await;
    drop(store);
    // The manager is stopped when its last connection is closed, which SQLite shows by removing
    // the WAL after checkpointing it. sqlx's `Pool::close` may return while a connection is still
    // on its way back to the pool (it is closed later, when the pool is dropped); restoring before
    // that connection checkpoints would let it write Bob into the restored file.
    let wal = dir.path().join("manager.db-wal");
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    while wal.exists() {
        assert!(
            std::time::Instant::now() < deadline,
            "the store's last connection did not close within 10 s: {} is still there",
            wal.display()
        );
        tokio::time::sleep(std::time::Duration::from_millis(10)).await;
    }

    // Restore: the manager is stopped; the backup replaces the file, the WAL and shared-memory
    // files of the old one go.
    for stale in ["manager.db-wal", "manager.db-shm"] {
        let _ = std::fs::remove_file(dir.path().join(stale));
    }
    std::fs::copy(&backup, &file).unwrap();
    let store = SqliteStore::open(&file).await.unwrap();
    let users: Vec<String> = store
        .users()
        .await
        .unwrap()
        .into_iter()
        .map(|u| u.dn.to_string())
        .collect();
    assert_eq!(users, [alice.to_string()]);
    store.close().await;
}
