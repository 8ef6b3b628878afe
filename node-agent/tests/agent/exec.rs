//! Processes started with runc beside dockerd (`runtime::direct`) against the real Docker
//! daemon: in the same dev container, a process started directly and one started by
//! `docker exec` must see the same isolation (user and groups, capabilities, no-new-privileges,
//! seccomp, cgroup, namespaces, limits, environment), with pipes and with a terminal. A
//! container runc does not know gets `docker exec`.

use std::collections::BTreeMap;
use std::sync::Arc;

use futures::StreamExt;
use ongrid_agent::runtime::direct::ExecConfig;
use ongrid_agent::runtime::docker::DockerRuntime;
use ongrid_agent::runtime::{
    ContainerRuntime, ExecOutput, ExecProcess, ExecSpec, SessionContainer, TtySize,
};
use ongrid_agent::streams::exec::{exec_spec, wait_for_exit, Program};
use ongrid_core::api::DesiredSession;
use tokio::io::AsyncWriteExt;

use crate::{direct_exec, TestNode};

/// What a process can learn of its own confinement. Every line names what it is, so a
/// difference reads as what differs.
const PROBE: &str = r#"
echo "uid $(id -u) gid $(id -g) groups $(id -G)"
grep -E '^(Uid|Gid|Groups|Cap(Inh|Prm|Eff|Bnd|Amb)|NoNewPrivs|Seccomp|Seccomp_filters):' /proc/self/status
sed 's/^/cgroup /' /proc/self/cgroup
for ns in cgroup ipc mnt net pid time user uts; do echo "ns $ns $(readlink /proc/self/ns/$ns)"; done
echo "apparmor $(cat /proc/self/attr/current 2>/dev/null)"
echo "oom_score_adj $(cat /proc/self/oom_score_adj)"
sed 's/^/limit /' /proc/self/limits
echo "cwd $(pwd)"
echo "parent $PPID"
env | sort | sed 's/^/env /'
if [ -t 0 ]; then echo "stdin is a terminal $(stty size)"; else echo "stdin is not a terminal"; fi
exit 7
"#;

async fn start_session(node: &TestNode) -> (DesiredSession, SessionContainer) {
    let session = node.running_session().await;
    let container = node
        .runtime
        .session_container(session.session_id)
        .await
        .expect("Docker answers")
        .expect("the session's container");
    (session, container)
}

/// Runs a started process to its end: its output (stdout and stderr together, a terminal's
/// line ends made plain) and exit code.
async fn finish(
    runtime: &dyn ContainerRuntime,
    mut process: ExecProcess,
    tty: bool,
) -> (String, i64) {
    // Closing a terminal's input would make Docker end the attach before the output came.
    if !tty {
        let _ = process.input.shutdown().await;
    }
    let mut output = Vec::new();
    while let Some(chunk) = process.output.next().await {
        match chunk.expect("output") {
            ExecOutput::Stdout(bytes) | ExecOutput::Stderr(bytes) => output.extend(bytes),
        }
    }
    let code = wait_for_exit(runtime, &process.id)
        .await
        .expect("exit code");
    (String::from_utf8_lossy(&output).replace("\r\n", "\n"), code)
}

/// The probe's lines by what they name, for a readable comparison.
fn lines(output: &str) -> BTreeMap<String, String> {
    output
        .lines()
        .enumerate()
        .map(|(i, line)| {
            let key = line
                .split_once([' ', ':'])
                .map_or(line, |(key, _)| key)
                .to_owned();
            (format!("{key} {i:03}"), line.to_owned())
        })
        .collect()
}

fn host_namespace(ns: &str) -> String {
    std::fs::read_link(format!("/proc/self/ns/{ns}"))
        .expect("the test's namespaces")
        .display()
        .to_string()
}

async fn compare(runtime: &DockerRuntime, container: &SessionContainer, spec: &ExecSpec) -> String {
    let docker = runtime
        .exec_in(&container.id, spec)
        .await
        .expect("docker exec");
    assert!(!docker.id.starts_with("direct-"), "{}", docker.id);
    let (through_docker, docker_code) = finish(runtime, docker, spec.tty.is_some()).await;

    let direct = runtime
        .start_exec(&container.id, spec)
        .await
        .expect("direct exec");
    assert!(
        direct.id.starts_with("direct-"),
        "started with runc, not docker exec: {}",
        direct.id
    );
    let (directly, direct_code) = finish(runtime, direct, spec.tty.is_some()).await;

    assert_eq!((docker_code, direct_code), (7, 7));
    assert!(
        through_docker.contains("NoNewPrivs"),
        "the probe ran: {through_docker}"
    );
    assert_eq!(
        lines(&directly),
        lines(&through_docker),
        "the process started with runc (left) and by docker exec (right) differ"
    );
    directly
}

#[tokio::test]
async fn a_process_started_with_runc_is_confined_exactly_as_a_docker_exec() {
    let node = TestNode::new().await;
    let (session, container) = start_session(&node).await;
    let spec = exec_spec(
        &container,
        &Program::Command(PROBE.to_owned()),
        None,
        &[("LANG".to_owned(), "C.UTF-8".to_owned())],
    );
    let output = compare(&node.runtime, &container, &spec).await;

    // And what both must be, so that equal cannot mean equally wrong.
    let uid = session.user.uid;
    assert!(
        output.contains(&format!("uid {uid} gid {uid} ")),
        "the container's user: {output}"
    );
    for expected in [
        "NoNewPrivs:\t1",
        "Seccomp:\t2",
        "CapEff:\t0000000000000000",
        "CapPrm:\t0000000000000000",
        "CapAmb:\t0000000000000000",
        "stdin is not a terminal",
        "env LANG=C.UTF-8",
        &format!("cwd /home/{}", session.user.name),
        // The process has no parent in the container's PID namespace.
        "parent 0",
    ] {
        assert!(output.contains(expected), "{expected:?} in:\n{output}");
    }
    // (The cgroup namespace is the host's under cgroup v1, where Docker's default is "host".)
    for ns in ["ipc", "mnt", "net", "pid", "uts"] {
        let line = output
            .lines()
            .find(|l| l.starts_with(&format!("ns {ns} ")))
            .unwrap_or_else(|| panic!("namespace {ns} in:\n{output}"));
        assert!(
            !line.ends_with(&host_namespace(ns)),
            "the {ns} namespace is the host's: {line}"
        );
    }
    let cgroup = output
        .lines()
        .find(|l| l.starts_with("cgroup ") && l.contains("memory"))
        .or_else(|| output.lines().find(|l| l.starts_with("cgroup 0::")))
        .unwrap_or_else(|| panic!("a cgroup line in:\n{output}"));
    assert!(
        cgroup.contains(&container.id),
        "the container's cgroup: {cgroup}"
    );
}

#[tokio::test]
async fn a_terminal_started_with_runc_is_the_containers_own_of_the_asked_size() {
    let node = TestNode::new().await;
    let (_session, container) = start_session(&node).await;
    let pty = ongrid_core::stream::Pty {
        term: "xterm-256color".to_owned(),
        cols: 101,
        rows: 33,
    };
    let spec = exec_spec(
        &container,
        &Program::Command(format!("{PROBE}\n")),
        Some(&pty),
        &[],
    );
    assert_eq!(
        spec.tty,
        Some(TtySize {
            cols: 101,
            rows: 33
        })
    );
    let output = compare(&node.runtime, &container, &spec).await;
    assert!(
        output.contains("stdin is a terminal 33 101"),
        "the terminal's size: {output}"
    );
    assert!(output.contains("env TERM=xterm-256color"), "{output}");
}

#[tokio::test]
async fn a_container_runc_does_not_know_gets_docker_exec() {
    let node = TestNode::new().await;
    let (_session, container) = start_session(&node).await;
    let empty = tempfile::tempdir().expect("temp dir");
    let runtime: Arc<DockerRuntime> = Arc::new(
        DockerRuntime::connect(node.node.clone())
            .await
            .expect("Docker")
            .with_direct_exec(Some(direct_exec(&ExecConfig {
                runc_root: empty.path().to_owned(),
                ..ExecConfig::default()
            }))),
    );
    let spec = exec_spec(
        &container,
        &Program::Command("echo through docker exec; exit 3".to_owned()),
        None,
        &[],
    );
    let process = runtime
        .start_exec(&container.id, &spec)
        .await
        .expect("docker exec");
    assert!(!process.id.starts_with("direct-"), "{}", process.id);
    let (output, code) = finish(runtime.as_ref(), process, false).await;
    assert_eq!((output.as_str(), code), ("through docker exec\n", 3));
}

#[tokio::test]
async fn a_child_left_in_the_background_does_not_hold_the_output_open() {
    let node = TestNode::new().await;
    let (_session, container) = start_session(&node).await;
    // The background sleep keeps stdout and stderr open for 300 s; docker exec's streams end
    // 2 s after the process, and so must a direct process's.
    let spec = exec_spec(
        &container,
        &Program::Command("sleep 300 & echo started; exit 4".to_owned()),
        None,
        &[],
    );
    let process = node
        .runtime
        .start_exec(&container.id, &spec)
        .await
        .expect("direct exec");
    assert!(process.id.starts_with("direct-"), "{}", process.id);
    let finished = tokio::time::timeout(
        std::time::Duration::from_secs(60),
        finish(node.runtime.as_ref(), process, false),
    )
    .await
    .expect("the output ended long before the background sleep");
    assert_eq!(finished, ("started\n".to_owned(), 4));
}
