//! The fault suite: the real manager, agent and gateway killed with SIGKILL (a crash, never the
//! graceful stop) at points of session start, release and freeze, an image store that fills up,
//! and restarts of a Docker daemon the test starts itself, with and without live-restore. After
//! each fault the component is started again and the test asserts convergence within a stated
//! bound, by polling (never a fixed sleep):
//!
//! - every session reaches the state it should be in (WAITING, HELD, FAILED with a reason),
//! - it has exactly one container (`docker ps -a --filter label=ongrid.session=<id>`), the same
//!   one when the session had one before the fault,
//! - an image is recorded once, READY or FAILED with a reason, and `<store>/.partial/` is empty,
//! - ssh through the gateway works again where the session runs.
//!
//! Its own test binary, so cargo never runs it beside the e2e one.

mod daemon;
mod freeze;
mod kill;

use std::path::Path;
use std::process::Output;
use std::time::Duration;

use ongrid_e2e::{docker_lines, inspect_container, Site, User};
use serde_json::Value;

/// How long a session may take to reach its state after a component is back.
pub const CONVERGE: Duration = Duration::from_secs(30);

pub fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

pub fn explain(out: &Output) -> String {
    format!(
        "status {}\nstdout: {}\nstderr: {}",
        out.status,
        text(&out.stdout),
        text(&out.stderr)
    )
}

/// `devctl session show NAME`; panics with the logs when it fails.
pub fn show(site: &Site, user: &User, name: &str) -> Value {
    site.devctl_json(user, &["session", "show", name])
        .unwrap_or_else(|e| panic!("devctl session show {name}: {e}\n{}", site.logs()))
}

/// Waits up to `bound` until session `name` is in `state`.
pub fn converges_to(site: &Site, user: &User, name: &str, state: &str, bound: Duration) -> Value {
    site.wait_until(&format!("session {name} to be {state}"), bound, || {
        let view: Value = site.devctl_json(user, &["session", "show", name]).ok()?;
        (view["state"] == state).then_some(view)
    })
}

/// The ids of every container, in any state, labelled with session `id`.
pub fn containers_of(id: &str) -> Vec<String> {
    docker_lines(&[
        "ps",
        "-aq",
        "--no-trunc",
        "--filter",
        &format!("label=ongrid.session={id}"),
    ])
}

/// Asserts that session `view` has exactly one container and returns its full id.
pub fn one_container(site: &Site, view: &Value) -> String {
    let id = view["id"].as_str().expect("session id");
    let containers = containers_of(id);
    assert_eq!(
        containers.len(),
        1,
        "session {id} must have exactly one container: {containers:?}\n{}",
        site.logs()
    );
    containers[0].clone()
}

/// The full id of a session's container, through its name.
pub fn container_id(view: &Value) -> String {
    let name = view["container"].as_str().expect("container name");
    inspect_container(name).expect("the container exists")["Id"]
        .as_str()
        .expect("container id")
        .to_owned()
}

/// Whether the container named in `view` runs.
pub fn running(view: &Value) -> bool {
    view["container"]
        .as_str()
        .and_then(inspect_container)
        .is_some_and(|c| c["State"]["Running"] == true)
}

/// The states a session went through, in order.
pub fn states(view: &Value) -> Vec<String> {
    view["transitions"]
        .as_array()
        .map(|ts| {
            ts.iter()
                .map(|t| t["to"].as_str().unwrap_or("").to_owned())
                .collect()
        })
        .unwrap_or_default()
}

/// The entries of `<store>/.partial/` (none once every freeze has finished or been cleaned up).
pub fn partial_entries(store: &Path) -> Vec<String> {
    std::fs::read_dir(store.join(".partial"))
        .map(|entries| {
            entries
                .flatten()
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .collect()
        })
        .unwrap_or_default()
}

/// Waits up to `bound` until `<store>/.partial/` is empty.
pub fn no_partial_work(site: &Site, bound: Duration) {
    let store = site.images_dir();
    site.wait_until("no work left in <store>/.partial/", bound, || {
        partial_entries(&store).is_empty().then_some(())
    });
}

/// Runs `ssh user@gateway command` until it succeeds, up to `bound` (the allowlist and a
/// restarted gateway or agent need a moment).
pub fn ssh_works(site: &Site, user: &User, target: &str, command: &str, bound: Duration) -> Output {
    site.wait_until(
        &format!("ssh {target} {command:?} to succeed"),
        bound,
        || {
            let out = site.ssh(user, target, command, b"");
            out.status.success().then_some(out)
        },
    )
}

/// Polls `check` every 20 ms (for catching a short moment such as a container being created)
/// until it returns `Some`, up to `bound`.
pub fn catch<T>(
    site: &Site,
    what: &str,
    bound: Duration,
    mut check: impl FnMut() -> Option<T>,
) -> T {
    let start = std::time::Instant::now();
    loop {
        if let Some(value) = check() {
            return value;
        }
        if start.elapsed() > bound {
            panic!(
                "timed out after {bound:?} waiting for {what}\n{}",
                site.logs()
            );
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}
