//! Faults during a freeze (the image BUILDING): the agent killed, the manager killed, and an
//! image store too small for the image.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use ongrid_e2e::{docker_lines, SimGpu, Site, User};
use serde_json::Value;

use crate::{
    converges_to, no_partial_work, one_container, partial_entries, running, show, ssh_works,
    CONVERGE,
};

/// How long a freeze of the dev image may take on a test machine.
const FREEZE: Duration = Duration::from_secs(180);

/// Removes the Docker image tags a test's freezes made (the harness removes only containers
/// and volumes), also when the test fails.
struct FrozenTags(Vec<String>);

impl Drop for FrozenTags {
    fn drop(&mut self) {
        for tag in &self.0 {
            let _ = Command::new("docker")
                .args(["image", "rm", "-f", tag])
                .output();
        }
    }
}

/// A site with loopback allowed, Alice's key, and her running session `train1`.
fn site_with_session() -> (Site, User, Value) {
    let mut site = Site::start(&[SimGpu::a100(1)]);
    site.allow_loopback();
    let alice = site.user("Alice");
    site.add_key(&alice);
    site.devctl_ok(&alice, &["session", "new", "--name", "train1", "--wait"]);
    let view = show(&site, &alice, "train1");
    (site, alice, view)
}

/// `devctl image show TAG`.
fn image(site: &Site, user: &User, tag: &str) -> Value {
    site.devctl_json(user, &["image", "show", tag])
        .unwrap_or_else(|e| panic!("devctl image show {tag}: {e}\n{}", site.logs()))
}

/// Starts a freeze of `train1` to `tag` without waiting; returns the image id once the agent
/// works on it (its work directory exists).
fn freeze_started(site: &Site, user: &User, tag: &str) -> String {
    site.devctl_ok(user, &["freeze", "train1", "--tag", tag, "--no-wait"]);
    let id = image(site, user, tag)["id"]
        .as_str()
        .expect("image id")
        .to_owned();
    let work = format!("{}-{id}", site.node);
    let store = site.images_dir();
    crate::catch(site, "the agent to start the freeze", CONVERGE, || {
        partial_entries(&store).contains(&work).then_some(())
    });
    id
}

/// The images of `user` with reference `tag`.
fn records_of(site: &Site, user: &User, tag: &str) -> Vec<Value> {
    let all: Vec<Value> = site
        .devctl_json(user, &["image", "ls"])
        .expect("devctl image ls");
    all.into_iter().filter(|i| i["reference"] == tag).collect()
}

/// Waits up to `bound` for the image to leave BUILDING; returns it.
fn finished(site: &Site, user: &User, tag: &str, bound: Duration) -> Value {
    site.wait_until(&format!("image {tag} to finish"), bound, || {
        let view: Value = site.devctl_json(user, &["image", "show", tag]).ok()?;
        (view["state"] != "BUILDING").then_some(view)
    })
}

/// The session of a freeze is untouched: running (WAITING, or IDLE after an ssh), never
/// failed, its one container running, ssh works.
fn session_unaffected(site: &Site, user: &User, before: &Value) {
    let view = site.wait_until("session train1 to run", CONVERGE, || {
        let view: Value = site
            .devctl_json(user, &["session", "show", "train1"])
            .ok()?;
        matches!(
            view["state"].as_str(),
            Some("WAITING" | "CONNECTED" | "IDLE")
        )
        .then_some(view)
    });
    assert!(
        !crate::states(&view).iter().any(|s| s == "FAILED"),
        "{view:#}"
    );
    assert_eq!(one_container(site, &view), one_container(site, before));
    assert!(running(&view), "{view:#}");
    ssh_works(site, user, "train1", "true", CONVERGE);
}

/// The freeze's throwaway export container is gone.
fn no_export_container(site: &Site, image_id: &str) {
    let name = format!("ongrid-freeze-{}", image_id.replace('-', ""));
    site.wait_until("the export container to be removed", CONVERGE, || {
        docker_lines(&["ps", "-aq", "--filter", &format!("name={name}")])
            .is_empty()
            .then_some(())
    });
}

fn sif_files(store: &Path) -> Vec<PathBuf> {
    std::fs::read_dir(store.join("sha256"))
        .map(|entries| entries.flatten().map(|e| e.path()).collect())
        .unwrap_or_default()
}

/// Agent killed while the image is BUILDING, twice: as soon as the freeze's work directory exists
/// (the commit), and once the committed image exists and the export runs. Each time the
/// restarted agent finds the work directory of an order it does not know and fails the image
/// within 30 s, saying to freeze again; nothing is left in `.partial/`, no export container, no
/// committed image; the session runs on. A new freeze of the same tag is READY, and the tag has
/// one READY record and one SIF.
#[test]
fn agent_killed_during_freeze_the_image_fails_within_30s_and_nothing_is_left() {
    let (mut site, alice, before) = site_with_session();
    let login = site.login_of("Alice");
    let _tags = FrozenTags(vec![
        format!("ongrid/{login}/faulty:v1"),
        format!("ongrid/{login}/faulty:v2"),
    ]);

    for (tag, during_export) in [("faulty:v1", false), ("faulty:v2", true)] {
        let id = freeze_started(&site, &alice, tag);
        let work = site
            .images_dir()
            .join(".partial")
            .join(format!("{}-{id}", site.node));
        let export = format!("ongrid-freeze-{}", id.replace('-', ""));
        let committed = during_export.then(|| {
            crate::catch(&site, "the export of the committed image", FREEZE, || {
                let image = std::fs::read_to_string(work.join("image-id")).ok()?;
                let exporting =
                    !docker_lines(&["ps", "-aq", "--filter", &format!("name={export}")]).is_empty();
                exporting.then(|| image.trim().to_owned())
            })
        });
        site.kill_agent();
        site.start_agent();

        let failed = finished(&site, &alice, tag, CONVERGE);
        assert_eq!(failed["state"], "FAILED", "{failed:#}");
        assert_eq!(
            failed["reason"], "the node agent restarted during the freeze: run devctl freeze again",
            "{failed:#}"
        );
        no_partial_work(&site, CONVERGE);
        no_export_container(&site, &id);
        // No image of this freeze is left: the commit and the import carry the image id.
        let label = format!("label=ongrid.frozen.image={id}");
        site.wait_until("the committed image to be removed", CONVERGE, || {
            docker_lines(&["images", "-aq", "--filter", &label])
                .is_empty()
                .then_some(())
        });
        if let Some(image) = committed {
            let inspect = Command::new("docker")
                .args(["image", "inspect", "--format", "{{.Id}}", &image])
                .output()
                .expect("docker image inspect");
            assert!(!inspect.status.success(), "{image} is left");
        }
        assert!(sif_files(&site.images_dir()).is_empty());
        assert_eq!(records_of(&site, &alice, tag).len(), 1);
        session_unaffected(&site, &alice, &before);
    }

    // Freezing again works, and the tag has exactly one READY image.
    site.devctl_ok(
        &alice,
        &["freeze", "train1", "--tag", "faulty:v1", "--no-wait"],
    );
    let ready = finished(&site, &alice, "faulty:v1", FREEZE);
    assert_eq!(ready["state"], "READY", "{ready:#}\n{}", site.logs());
    let records = records_of(&site, &alice, "faulty:v1");
    let ready_count = records.iter().filter(|r| r["state"] == "READY").count();
    assert_eq!(ready_count, 1, "{records:#?}");
    assert_eq!(sif_files(&site.images_dir()).len(), 1);
    no_partial_work(&site, CONVERGE);
}

/// Manager killed while the image is BUILDING: the agent finishes the freeze meanwhile and keeps
/// reporting it; the restarted manager records it READY once (within 180 s of the start), one
/// SIF file, nothing in `.partial/`, the session running.
#[test]
fn manager_killed_during_freeze_the_image_is_ready_once_within_180s() {
    let (mut site, alice, before) = site_with_session();
    let login = site.login_of("Alice");
    let _tags = FrozenTags(vec![format!("ongrid/{login}/crash:v1")]);

    let id = freeze_started(&site, &alice, "crash:v1");
    site.kill_manager();
    site.start_manager();

    let ready = finished(&site, &alice, "crash:v1", FREEZE);
    assert_eq!(ready["state"], "READY", "{ready:#}\n{}", site.logs());
    assert_eq!(ready["id"], id.as_str(), "the same image record");
    let records = records_of(&site, &alice, "crash:v1");
    assert_eq!(records.len(), 1, "one record: {records:#?}");
    let sifs = sif_files(&site.images_dir());
    assert_eq!(sifs.len(), 1, "{sifs:?}");
    assert_eq!(
        ready["sif_path"],
        sifs[0].display().to_string().as_str(),
        "{ready:#}"
    );
    no_partial_work(&site, CONVERGE);
    no_export_container(&site, &id);
    session_unaffected(&site, &alice, &before);
}

/// A tmpfs mounted over a directory for the life of a test; unmounted when dropped.
struct Tmpfs(PathBuf);

impl Tmpfs {
    /// `mount -t tmpfs -o size=SIZE tmpfs DIR` (needs root, as the agent does).
    fn mount(dir: &Path, size: &str) -> Self {
        std::fs::create_dir_all(dir).expect("make the mount point");
        let out = Command::new("mount")
            .args(["-t", "tmpfs", "-o", &format!("size={size}"), "tmpfs"])
            .arg(dir)
            .output()
            .expect("run mount");
        assert!(
            out.status.success(),
            "mounting a tmpfs on {} (the fault tests need root): {}",
            dir.display(),
            String::from_utf8_lossy(&out.stderr)
        );
        Self(dir.to_path_buf())
    }
}

impl Drop for Tmpfs {
    fn drop(&mut self) {
        let _ = Command::new("umount").arg(&self.0).output();
    }
}

/// A full image store: the store is an 8 MiB tmpfs, far smaller than the dev image; then the
/// same store filled by other files to 2 MiB free. Each freeze fails within 180 s with a reason
/// that names the full store and what to do; `.partial/` is empty, no SIF is published, and the
/// session runs on, still reachable over ssh.
#[test]
fn a_full_image_store_fails_the_freeze_with_the_reason_and_the_session_runs_on() {
    let (mut site, alice, before) = site_with_session();
    let login = site.login_of("Alice");
    let _tags = FrozenTags(vec![
        format!("ongrid/{login}/huge:v1"),
        format!("ongrid/{login}/huge:v2"),
    ]);
    // The agent reads its store at start: stop it, put the small filesystem in place, start it.
    site.stop_agent();
    let _store = Tmpfs::mount(&site.images_dir(), "8m");
    site.start_agent();
    converges_to(&site, &alice, "train1", "WAITING", CONVERGE);
    let store = site.images_dir().display().to_string();

    for (tag, filler) in [("huge:v1", 0), ("huge:v2", 6 << 20)] {
        let ballast = site.images_dir().join("ballast");
        std::fs::write(&ballast, vec![1u8; filler]).expect("fill the store");
        site.devctl_ok(&alice, &["freeze", "train1", "--tag", tag, "--no-wait"]);
        let failed = finished(&site, &alice, tag, FREEZE);
        assert_eq!(failed["state"], "FAILED", "{failed:#}");
        assert_eq!(
            failed["reason"].as_str().unwrap_or_default(),
            format!("image store {store} is full: free space or ask the admin"),
            "{tag} with {filler} bytes of other files: {failed:#}"
        );
        no_partial_work(&site, CONVERGE);
        assert!(sif_files(&site.images_dir()).is_empty());
        let id = failed["id"].as_str().expect("image id").to_owned();
        no_export_container(&site, &id);
        assert_eq!(records_of(&site, &alice, tag).len(), 1);
        session_unaffected(&site, &alice, &before);
    }
}
