//! The Docker CLI as the tests use it, on the machine's daemon or a test's own (`-H`): the dev
//! image's tag, names kept apart, lines and inspections of what a command lists.

use std::io::Read;
use std::process::{Command, Stdio};

use serde_json::Value;

/// The dev image every test container runs; built by `images/dev/build.sh`.
pub const DEV_IMAGE: &str = "ongrid/dev:latest";

/// A short random lower-case suffix that keeps names of parallel tests apart.
pub fn unique_suffix() -> String {
    uuid::Uuid::new_v4().simple().to_string()[..8].to_owned()
}

/// `docker`, against the daemon at `host` (the machine's: `None`).
pub(crate) fn docker_on(host: Option<&str>) -> Command {
    let mut command = Command::new("docker");
    if let Some(host) = host {
        command.arg("-H").arg(host);
    }
    command
}

/// Runs a docker CLI command and returns its non-empty stdout lines.
pub fn docker_lines(args: &[&str]) -> Vec<String> {
    docker_lines_on(None, args)
}

/// [`docker_lines`] against the daemon at `host` (the machine's: `None`).
pub fn docker_lines_on(host: Option<&str>, args: &[&str]) -> Vec<String> {
    let out = docker_on(host).args(args).output().expect("run docker");
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter(|l| !l.trim().is_empty())
        .map(str::to_owned)
        .collect()
}

/// `docker inspect` of one container, or `None` when it does not exist.
pub fn inspect_container(name: &str) -> Option<Value> {
    inspect_container_on(None, name)
}

/// [`inspect_container`] on the daemon at `host` (the machine's: `None`).
pub fn inspect_container_on(host: Option<&str>, name: &str) -> Option<Value> {
    let out = docker_on(host)
        .args(["inspect", "--type", "container", name])
        .output()
        .ok()?;
    if !out.status.success() {
        return None;
    }
    let mut list: Vec<Value> = serde_json::from_slice(&out.stdout).ok()?;
    list.pop()
}

/// Runs a command in a container as its configured user; returns (exit code, stdout).
pub fn docker_exec(container: &str, command: &[&str]) -> (i32, String) {
    let mut child = Command::new("docker")
        .arg("exec")
        .arg(container)
        .args(command)
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .expect("run docker exec");
    let mut stdout = String::new();
    child
        .stdout
        .take()
        .expect("stdout")
        .read_to_string(&mut stdout)
        .expect("read stdout");
    let status = child.wait().expect("wait for docker exec");
    (status.code().unwrap_or(-1), stdout)
}
