//! Site storage (`[storage]`) against the real Docker daemon: a home on site storage follows its
//! user from one node's agent to another's, read-only binds refuse writes, read-write mounts
//! take them, batch jobs get the same mounts, and a freeze leaves everything mounted out of the
//! SIF and the Docker image.
//!
//! Two nodes are two agents' node names on the one Docker daemon (each only sees its own
//! containers), sharing one directory as their "site storage", as two GPU nodes share NFS.

use std::os::unix::fs::MetadataExt;
use std::path::Path;
use std::sync::Arc;

use ongrid_agent::reconcile::Reconciler;
use ongrid_agent::runtime::GpuAccess;
use ongrid_agent::storage::{SiteStorage, StorageFile};
use ongrid_core::api::{ContainerState, DesiredSession};
use ongrid_core::image::FreezeProgress;

use crate::freeze::{finished, freezer, order, partition_offset, squashfs_listing};
use crate::{docker, exists, TestNode};

/// The site's storage: homes, a read-only software area with one tool, and per-user scratch.
struct Site {
    dir: tempfile::TempDir,
}

impl Site {
    fn new() -> Self {
        let dir = tempfile::tempdir().expect("temp dir");
        for sub in ["home", "software/bin", "scratch"] {
            std::fs::create_dir_all(dir.path().join(sub)).expect("site dirs");
        }
        std::fs::write(dir.path().join("software/bin/tool"), "site tool v1\n").expect("tool");
        Self { dir }
    }

    fn path(&self, sub: &str) -> String {
        self.dir.path().join(sub).display().to_string()
    }

    /// The `[storage]` table of every node of the site, validated as the agent does.
    fn storage(&self) -> SiteStorage {
        let text = format!(
            "home = \"{home}/{{login}}\"\nhome_mode = \"0750\"\n\
             [[read_only]]\nsource = \"{software}\"\ntarget = \"/software\"\n\
             [[read_write]]\nsource = \"{scratch}/{{login}}\"\ntarget = \"/scratch\"\n",
            home = self.path("home"),
            software = self.path("software"),
            scratch = self.path("scratch"),
        );
        let file: StorageFile = toml::from_str(&text).expect("a [storage] table");
        file.validate().expect("a valid [storage] table")
    }

    /// The user's scratch directory, made by the site (ongrid only makes homes).
    fn scratch_for(&self, session: &DesiredSession) -> std::path::PathBuf {
        let path = self
            .dir
            .path()
            .join("scratch")
            .join(session.user.name.as_str());
        std::fs::create_dir(&path).expect("scratch dir");
        std::os::unix::fs::chown(&path, Some(session.user.uid), Some(session.user.uid))
            .expect("chown scratch");
        path
    }
}

fn reconciler(node: &TestNode, storage: &SiteStorage) -> Reconciler {
    let mut guard = node.guard();
    guard.storage = Arc::new(storage.clone());
    Reconciler::new(
        node.runtime.clone(),
        node.node.clone(),
        GpuAccess::EnvironmentOnly,
        guard,
    )
}

/// Converges and returns the state and problem of the session's container.
async fn converge(
    reconciler: &mut Reconciler,
    desired: &[DesiredSession],
) -> Vec<(ContainerState, Option<String>)> {
    reconciler.converge(desired).await.expect("Docker answers");
    reconciler
        .observe()
        .await
        .expect("Docker lists containers")
        .into_iter()
        .map(|c| (c.state, c.error))
        .collect()
}

/// Runs a script in the session's container as its user; its exit code, stdout and stderr.
fn exec(session: &DesiredSession, script: &str) -> (i32, String, String) {
    let output = std::process::Command::new("docker")
        .args([
            "exec",
            &session.session_id.container_name(),
            "bash",
            "-c",
            script,
        ])
        .output()
        .expect("the docker CLI");
    (
        output.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&output.stdout).trim().to_owned(),
        String::from_utf8_lossy(&output.stderr).trim().to_owned(),
    )
}

fn exec_ok(session: &DesiredSession, script: &str) -> String {
    let (code, stdout, stderr) = exec(session, script);
    assert_eq!(code, 0, "{script}: {stderr}");
    stdout
}

#[tokio::test]
async fn a_home_on_site_storage_follows_its_user_to_another_node() {
    let site = Site::new();
    let storage = site.storage();
    let node_a = TestNode::new().await;
    let node_b = TestNode::new().await;
    let first = node_a.session();
    let scratch = site.scratch_for(&first);
    let home = site.dir.path().join("home").join(first.user.name.as_str());
    assert!(!home.exists());

    let mut agent_a = reconciler(&node_a, &storage);
    let report = converge(&mut agent_a, std::slice::from_ref(&first)).await;
    assert_eq!(report, [(ContainerState::Running, None)]);
    // The agent made the home for the user, with the configured mode, and no volume.
    let meta = std::fs::metadata(&home).expect("the home was made");
    assert_eq!((meta.uid(), meta.gid()), (first.user.uid, first.user.uid));
    assert_eq!(meta.mode() & 0o7777, 0o750);
    assert!(!exists(
        "volume",
        &format!("ongrid-home-{}", first.user.name)
    ));
    exec_ok(
        &first,
        "echo written on node A > ~/notes.txt; echo scratch > /scratch/out",
    );
    assert_eq!(
        std::fs::read_to_string(home.join("notes.txt")).expect("on site storage"),
        "written on node A\n"
    );
    assert_eq!(
        std::fs::read_to_string(scratch.join("out")).expect("in scratch"),
        "scratch\n"
    );

    // Read-only binds: readable, never writable, even where the user owns the directory.
    assert_eq!(exec_ok(&first, "cat /software/bin/tool"), "site tool v1");
    let (code, _, stderr) = exec(&first, "touch /software/bin/mine");
    assert_ne!(code, 0, "a read-only bind took a write");
    assert!(stderr.contains("Read-only file system"), "{stderr}");
    assert!(!site.dir.path().join("software/bin/mine").exists());

    // The session ends on node A; the user's next session lands on node B.
    assert!(converge(&mut agent_a, &[]).await.is_empty());
    let second = node_b.session_of(first.user.name.as_str(), first.user.uid);
    let mut agent_b = reconciler(&node_b, &storage);
    let report = converge(&mut agent_b, std::slice::from_ref(&second)).await;
    assert_eq!(report, [(ContainerState::Running, None)]);
    assert_eq!(exec_ok(&second, "cat ~/notes.txt"), "written on node A");
    assert_eq!(exec_ok(&second, "cat /scratch/out"), "scratch");
    assert_eq!(
        exec_ok(&second, "pwd; stat -c %u ~"),
        format!("/home/{}\n{}", first.user.name, first.user.uid)
    );
    exec_ok(&second, "echo and on node B >> ~/notes.txt");
    assert_eq!(
        std::fs::read_to_string(home.join("notes.txt")).expect("on site storage"),
        "written on node A\nand on node B\n"
    );
    let mounts = crate::inspect("container", &second.session_id.container_name())["Mounts"].clone();
    let software = mounts
        .as_array()
        .expect("mounts")
        .iter()
        .find(|m| m["Destination"] == "/software")
        .expect("the software area is mounted");
    assert_eq!(software["RW"], false);
    assert_eq!(software["Type"], "bind");
}

#[tokio::test]
async fn a_missing_scratch_directory_is_reported_with_the_fix() {
    let site = Site::new();
    let storage = site.storage();
    let node = TestNode::new().await;
    let session = node.session();
    let mut agent = reconciler(&node, &storage);
    let report = converge(&mut agent, std::slice::from_ref(&session)).await;
    let [(state, Some(error))] = report.as_slice() else {
        panic!("one container problem expected: {report:?}");
    };
    assert_eq!(*state, ContainerState::Missing);
    assert!(
        error.contains(&format!(
            "site storage {}/{} does not exist on this node: make it for user {} (uid {})",
            site.path("scratch"),
            session.user.name,
            session.user.name,
            session.user.uid
        )),
        "{error}"
    );
    site.scratch_for(&session);
    let report = converge(&mut agent, std::slice::from_ref(&session)).await;
    assert_eq!(report, [(ContainerState::Running, None)]);
}

/// Lists the SIF's squashfs: path → nothing else needed here.
fn sif_paths(sif: &str) -> Vec<String> {
    squashfs_listing(sif, partition_offset(sif))
        .into_keys()
        .collect()
}

#[tokio::test]
async fn a_freeze_leaves_out_everything_mounted() {
    let site = Site::new();
    let storage = site.storage();
    let node = TestNode::new().await;
    let session = node.session();
    site.scratch_for(&session);
    let mut agent = reconciler(&node, &storage);
    let report = converge(&mut agent, std::slice::from_ref(&session)).await;
    assert_eq!(report, [(ContainerState::Running, None)]);
    exec_ok(
        &session,
        "set -e; echo home > ~/home-file; echo scratch > /scratch/scratch-file",
    );
    docker(&[
        "exec",
        "-u",
        "0",
        &session.session_id.container_name(),
        "bash",
        "-c",
        "mkdir -p /opt/kept && echo kept > /opt/kept/file",
    ]);
    let store = tempfile::tempdir().expect("temp dir");
    let freezer = freezer(&node, store.path());
    let order = order(&session, "mounted:v1");
    freezer.apply(std::slice::from_ref(&order), std::slice::from_ref(&session));
    let (result, _, _) = finished(&freezer, order.image_id).await;
    let FreezeProgress::Done {
        sif_path,
        docker_image,
        ..
    } = result
    else {
        panic!("the freeze failed: {result:?}");
    };
    let paths = sif_paths(&sif_path);
    assert!(
        paths.iter().any(|p| p == "opt/kept/file"),
        "the image's own files are kept"
    );
    let login = session.user.name.as_str();
    for mounted in [
        format!("home/{login}/home-file"),
        "scratch/scratch-file".to_owned(),
        "software/bin/tool".to_owned(),
    ] {
        assert!(!paths.contains(&mounted), "{mounted} is in the SIF");
    }
    // What is left of a mount is at most its empty mount point.
    for point in [
        format!("home/{login}"),
        "scratch".to_owned(),
        "software".to_owned(),
    ] {
        let inside: Vec<&String> = paths
            .iter()
            .filter(|p| Path::new(p.as_str()).starts_with(&point) && **p != point)
            .collect();
        assert!(inside.is_empty(), "under {point} in the SIF: {inside:?}");
    }
    let listing = docker(&[
        "run",
        "--rm",
        &docker_image,
        "sh",
        "-c",
        &format!("find /software /scratch /home/{login} -mindepth 1 2>/dev/null; true"),
    ]);
    assert_eq!(listing, "", "the Docker image holds nothing mounted");
    freezer.apply(&[], std::slice::from_ref(&session));
    docker(&["image", "rm", "-f", &docker_image]);
}
