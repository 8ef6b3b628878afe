//! The agent's integration tests, one binary: the Docker runtime and the reconciler against the
//! real Docker daemon (`docker`), and the manager client and the whole sync loop against a fake
//! manager served over TLS in the test (`manager`), and the SSH gateway's stream endpoint with a
//! real WebSocket client over TLS (`streams`). The `nvidia-smi` backend (`nvidia_smi`) and `scripts/gpu-check.sh` (`gpu_check`) run against a
//! stand-in nvidia-smi (`fake_nvidia_smi`) and need no Docker.
//!
//! They need Docker and the image `ongrid/dev:latest` (built by `images/dev/build.sh`), and fail
//! loudly without them. Each test uses its own node name (the agent only sees containers labelled
//! with its node) and user names, and a [`Cleanup`] guard removes its containers and volumes
//! even when it fails. Containers are inspected with the `docker` CLI, independently of the code
//! under test.

mod docker;
mod exec;
mod fake_nvidia_smi;
mod freeze;
mod gpu_check;
mod isolation;
mod jobs;
mod lifecycle;
mod manager;
mod netns;
mod nvidia_smi;
mod storage;
mod streams;

use std::collections::BTreeMap;
use std::process::Command;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use ongrid_agent::network::iptables::Iptables;
use ongrid_agent::network::NetworkPolicy;
use ongrid_agent::reconcile::{NodeGuard, Reconciler};
use ongrid_agent::runtime::direct::{DirectExec, ExecConfig};
use ongrid_agent::runtime::docker::DockerRuntime;
use ongrid_agent::runtime::{GpuAccess, LimitCeiling};
use ongrid_core::api::{ContainerLimits, ContainerState, ContainerUser, DesiredSession, RunState};
use ongrid_core::{Dn, GpuId, MemorySize, NodeName, SessionId, SessionName, UserName};

pub const IMAGE: &str = "ongrid/dev:latest";

/// A short random lower-case hex string.
pub fn unique() -> String {
    uuid::Uuid::new_v4().simple().to_string()[..10].to_owned()
}

/// Runs `docker ARGS`; panics with its stderr when it fails.
pub fn docker(args: &[&str]) -> String {
    let output = Command::new("docker")
        .args(args)
        .output()
        .expect("the docker CLI must be installed for these tests");
    assert!(
        output.status.success(),
        "docker {} failed: {}",
        args.join(" "),
        String::from_utf8_lossy(&output.stderr)
    );
    String::from_utf8_lossy(&output.stdout).trim().to_owned()
}

/// `docker inspect` of one container or volume, as JSON.
pub fn inspect(kind: &str, name: &str) -> serde_json::Value {
    let text = docker(&[kind, "inspect", name]);
    let mut all: Vec<serde_json::Value> = serde_json::from_str(&text).expect("inspect is JSON");
    all.remove(0)
}

/// Whether a container or volume exists.
pub fn exists(kind: &str, name: &str) -> bool {
    Command::new("docker")
        .args([kind, "inspect", name])
        .output()
        .expect("the docker CLI must be installed for these tests")
        .status
        .success()
}

/// Processes through runc as the agent starts them, with the agent's binary as their helper;
/// panics when runc does not run here.
pub fn direct_exec(config: &ExecConfig) -> DirectExec {
    DirectExec::new(config, env!("CARGO_BIN_EXE_ongrid-agent").into())
        .expect("runc must run here (Debian's runc package comes with docker.io)")
}

/// One test's node on the shared Docker daemon; removes what it made when dropped: its
/// containers, networks, firewall rules and the home volumes of its users.
pub struct TestNode {
    pub node: NodeName,
    pub runtime: Arc<DockerRuntime>,
    /// The node's firewall rules, as the agent installs them (tests run as root).
    pub firewall: Arc<Iptables>,
    cleanup: Cleanup,
}

impl TestNode {
    /// Connects to Docker (panicking with the fix when it or the image is missing).
    pub async fn new() -> Self {
        Self::with_policy(NetworkPolicy::default_policy()).await
    }

    /// A node whose dev containers may connect where `policy` says.
    pub async fn with_policy(policy: NetworkPolicy) -> Self {
        let node = NodeName::parse(&format!("test-{}", unique())).expect("valid node name");
        let firewall = Arc::new(Iptables::new(&node, &policy));
        let cleanup = Cleanup {
            node: node.to_string(),
            volumes: Mutex::default(),
            firewall: firewall.clone(),
        };
        let runtime = DockerRuntime::connect(node.clone())
            .await
            .unwrap_or_else(|e| {
                panic!(
                    "these tests need the Docker daemon: {:#}",
                    anyhow::Error::from(e)
                )
            })
            .with_direct_exec(Some(direct_exec(&ExecConfig::default())));
        assert!(
            exists("image", IMAGE),
            "image {IMAGE} is missing: run images/dev/build.sh (as root) first"
        );
        Self {
            node,
            runtime: Arc::new(runtime),
            firewall,
            cleanup,
        }
    }

    /// What the reconciler needs to isolate this node's containers: the real firewall rules,
    /// the default address pool, and no limit ceiling (tests choose their limits).
    pub fn guard(&self) -> NodeGuard {
        NodeGuard {
            firewall: self.firewall.clone(),
            subnet_pool: NetworkPolicy::default_policy().subnet_pool,
            ceiling: LimitCeiling::NONE,
            storage: Default::default(),
        }
    }

    /// This node's reconciler (GPUs by environment only, this node's guard).
    pub fn reconciler(&self) -> Reconciler {
        Reconciler::new(
            self.runtime.clone(),
            self.node.clone(),
            GpuAccess::EnvironmentOnly,
            self.guard(),
        )
    }

    /// A new user's session whose dev container runs, converged by this node's reconciler.
    pub async fn running_session(&self) -> DesiredSession {
        let session = self.session();
        let mut reconciler = self.reconciler();
        reconciler
            .converge(std::slice::from_ref(&session))
            .await
            .expect("Docker answers");
        let observed = reconciler.observe().await.expect("Docker answers");
        assert_eq!(
            observed.first().map(|o| &o.state),
            Some(&ContainerState::Running),
            "the dev container must run: {observed:?}"
        );
        session
    }

    /// A session for a new user of this node (its home volume is removed with the node).
    pub fn session(&self) -> DesiredSession {
        let login = format!("u{}", unique());
        self.session_of(&login, 20000 + (rand_u16() as u32))
    }

    pub fn session_of(&self, login: &str, uid: u32) -> DesiredSession {
        self.cleanup
            .volumes
            .lock()
            .expect("not poisoned")
            .push(format!("ongrid-home-{login}"));
        DesiredSession {
            session_id: SessionId::new_random(),
            name: SessionName::parse("train1").expect("valid session name"),
            owner: Dn::parse("/DC=org/DC=example/CN=Test User").expect("valid DN"),
            user: ContainerUser {
                name: UserName::parse(login).expect("valid user name"),
                uid,
            },
            image: IMAGE.to_owned(),
            gpus: vec![GpuId::parse("GPU-11111111-2222-3333-4444-555555555501").expect("uuid")],
            run: RunState::Running,
            limits: ContainerLimits {
                millicpus: 500,
                memory: MemorySize::parse("256MiB").expect("size"),
                pids: 256,
            },
            labels: BTreeMap::new(),
            resume: false,
        }
    }
}

fn rand_u16() -> u16 {
    let bytes = uuid::Uuid::new_v4().into_bytes();
    u16::from_le_bytes([bytes[0], bytes[1]]) % 40000
}

/// Removes, on drop, every container and network labelled with the node, its firewall rules,
/// and the home volumes of its users.
struct Cleanup {
    node: String,
    volumes: Mutex<Vec<String>>,
    firewall: Arc<Iptables>,
}

impl Drop for Cleanup {
    fn drop(&mut self) {
        let run = |args: &[&str]| {
            Command::new("docker")
                .args(args)
                .output()
                .map(|o| String::from_utf8_lossy(&o.stdout).into_owned())
                .unwrap_or_default()
        };
        let label = format!("label=ongrid.node={}", self.node);
        let containers = run(&["ps", "-aq", "--filter", &label]);
        for id in containers.split_whitespace() {
            run(&["rm", "-f", "-v", id]);
        }
        let networks = run(&["network", "ls", "-q", "--filter", &label]);
        for id in networks.split_whitespace() {
            run(&["network", "rm", id]);
        }
        if let Err(e) = self.firewall.remove_blocking() {
            eprintln!("could not remove the firewall rules of {}: {e}", self.node);
        }
        let volumes = std::mem::take(self.volumes.get_mut().unwrap_or_else(|e| e.into_inner()));
        for volume in volumes {
            run(&["volume", "rm", "-f", &volume]);
        }
    }
}

/// Polls `check` every 100 ms until it gives a value, for at most `limit`.
pub async fn eventually<T>(limit: Duration, what: &str, mut check: impl FnMut() -> Option<T>) -> T {
    let deadline = tokio::time::Instant::now() + limit;
    loop {
        if let Some(value) = check() {
            return value;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "timed out after {limit:?} waiting for {what}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}
