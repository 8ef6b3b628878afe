//! Batch jobs on a real Slurm, end to end through the manager's API: a single-node Slurm
//! cluster from Debian's packages (`slurm/cluster.rs`: munged, slurmctld and slurmd in a
//! temporary directory, fake GPUs made with mknod, an `apptainer` stand-in on the jobs' PATH
//! that records its arguments and runs the command) and a manager in-process whose
//! `[targets.slurm]` points at it, polled every second.
//!
//! One test walks every path, because a Slurm cluster takes seconds to start and the time
//! limit takes a minute to pass: submit → RUNNING → FINISHED with the output and the recorded
//! `apptainer exec --nv <sif>`; a manager restart while a job runs; halt → SIGUSR1 reaches the
//! job, which exits 123 → HALTED, and being restartable its chain's next job is handed to Slurm
//! anew and runs as itself; exit 85 → Slurm re-queues it (RequeueExit) → HALTED and the next
//! job of the chain runs under the same Slurm id, with its own `ONGRID_JOB_ID`, and says in
//! Slurm's words why it waits meanwhile; cancel → CANCELLED and scancelled; a
//! max duration → Slurm's time limit (TIMEOUT → HALTED, max duration reached); a request beyond
//! the cluster refused with Slurm's words; a user without a local account refused; the targets
//! list.
//!
//! Needs root and `slurmctld slurmd slurm-client munge` (deploy/debian-packages.txt).

#![allow(clippy::unwrap_used)]

#[path = "slurm/cluster.rs"]
mod cluster;

use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::time::Duration;

use chrono::Utc;
use ongrid_core::api::{
    ContainerState, CreateSession, ErrorBody, NodeReport, ObservedContainer, RegisterNode,
    SessionView,
};
use ongrid_core::image::{CreateImage, FreezeProgress, ImageReference};
use ongrid_core::job::{
    JobSpecFile, JobState, JobTarget, JobView, LogChunk, SubmitJob, TargetInfo,
};
use ongrid_core::{
    ComputeCapability, GpuHealth, GpuInfo, GpuRequest, GpuUuid, MemorySize, NodeName, SessionName,
    SessionState,
};
use ongrid_manager::Config;
use rcgen::{
    BasicConstraints, CertificateParams, DistinguishedName, DnType, ExtendedKeyUsagePurpose, IsCa,
    KeyPair, SanType,
};
use reqwest::StatusCode;
use serde::de::DeserializeOwned;
use serde::Serialize;
use tokio::net::TcpListener;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

use cluster::SlurmCluster;

const NODE_TOKEN: &str = "node1-0123456789abcdef0123456789abcdef";
const ALICE: &str = "/DC=org/O=Example/CN=Alice Smith";
/// Alice's jobs run as this local account (it exists on every Debian system).
const ACCOUNT: &str = "nobody";
const DIGEST_HEX: &str = "cdcdcdcdcdcdcdcdcdcdcdcdcdcdcdcdcdcdcdcdcdcdcdcdcdcdcdcdcdcdcdcd";

struct Manager {
    shutdown: CancellationToken,
    task: JoinHandle<anyhow::Result<()>>,
    alice: Api,
    bob: Api,
    node: Api,
}

impl Manager {
    async fn start(config: &Config, site: &Site) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let shutdown = CancellationToken::new();
        let task = tokio::spawn(ongrid_manager::run(
            config.clone(),
            listener,
            shutdown.clone(),
        ));
        Self {
            shutdown,
            task,
            alice: Api::new(site.client(Some(&site.alice_pem)), addr, None),
            bob: Api::new(site.client(Some(&site.bob_pem)), addr, None),
            node: Api::new(site.client(None), addr, Some(NODE_TOKEN)),
        }
    }

    async fn stop(self) {
        self.shutdown.cancel();
        tokio::time::timeout(Duration::from_secs(20), self.task)
            .await
            .expect("the manager stops within 20 s")
            .unwrap()
            .unwrap();
    }
}

struct Site {
    dir: tempfile::TempDir,
    ca_pem: String,
    alice_pem: Vec<u8>,
    bob_pem: Vec<u8>,
}

fn person(ca: &rcgen::Certificate, ca_key: &KeyPair, cn: &str) -> Vec<u8> {
    let mut params = CertificateParams::default();
    params.distinguished_name = DistinguishedName::new();
    let dc = DnType::CustomDnType(vec![0, 9, 2342, 19200300, 100, 1, 25]);
    params.distinguished_name.push(dc, "org");
    params
        .distinguished_name
        .push(DnType::OrganizationName, "Example");
    params.distinguished_name.push(DnType::CommonName, cn);
    params.extended_key_usages = vec![ExtendedKeyUsagePurpose::ClientAuth];
    let key = KeyPair::generate().unwrap();
    let cert = params.signed_by(&key, ca, ca_key).unwrap();
    format!("{}{}", cert.pem(), key.serialize_pem()).into_bytes()
}

impl Site {
    fn new() -> Self {
        let dir = tempfile::tempdir().unwrap();
        let mut params = CertificateParams::default();
        params.distinguished_name = DistinguishedName::new();
        params
            .distinguished_name
            .push(DnType::CommonName, "ongrid Test CA");
        params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        let ca_key = KeyPair::generate().unwrap();
        let ca = params.self_signed(&ca_key).unwrap();
        let ca_dir = dir.path().join("certificates");
        std::fs::create_dir(&ca_dir).unwrap();
        std::fs::write(ca_dir.join("0ca0ca00.0"), ca.pem()).unwrap();
        let mut params = CertificateParams::default();
        params.distinguished_name = DistinguishedName::new();
        params
            .distinguished_name
            .push(DnType::CommonName, "manager.test");
        params.subject_alt_names = vec![SanType::IpAddress(IpAddr::V4(Ipv4Addr::LOCALHOST))];
        params.extended_key_usages = vec![ExtendedKeyUsagePurpose::ServerAuth];
        let key = KeyPair::generate().unwrap();
        let cert = params.signed_by(&key, &ca, &ca_key).unwrap();
        std::fs::write(dir.path().join("manager.crt"), cert.pem()).unwrap();
        std::fs::write(dir.path().join("manager.key"), key.serialize_pem()).unwrap();
        std::fs::write(
            dir.path().join("agent-tokens"),
            format!("node1 {NODE_TOKEN}\n"),
        )
        .unwrap();
        Self {
            alice_pem: person(&ca, &ca_key, "Alice Smith"),
            bob_pem: person(&ca, &ca_key, "Bob Jones"),
            ca_pem: ca.pem(),
            dir,
        }
    }

    /// The manager's config: the local target by default, and `[targets.slurm]` on `cluster`.
    fn config(&self, cluster: &SlurmCluster) -> Config {
        let d = self.dir.path();
        let text = format!(
            r#"
listen = "127.0.0.1:0"
database = "{db}"
tls_cert = "{d}/manager.crt"
tls_key = "{d}/manager.key"
ca_dir = "{d}/certificates"
agent_tokens_file = "{d}/agent-tokens"
node_timeout = "1 hour"

[targets]
default = "local"
poll_interval = "1 second"
accounts = [ {{ dn = "{ALICE}", account = "{ACCOUNT}" }} ]

[targets.slurm]
slurm_conf = "{conf}"
image_dir = "/srv/ongrid/images"
output_dir = "{out}"
partition = "gpu"
job_path = "{bin}:/usr/bin:/bin"
halt_lead = "10 seconds"
gpu_types = [
  {{ name = "a100", capability = "8.0", memory = "40G" }},
  {{ name = "t4", capability = "7.5", memory = "16G" }},
]
"#,
            db = d.join("manager.db").display(),
            d = d.display(),
            conf = cluster.conf.display(),
            out = cluster.output_dir.display(),
            bin = cluster.bin_dir.display(),
        );
        let path = d.join("manager.toml");
        std::fs::write(&path, &text).unwrap();
        Config::from_toml(&text, &path, |_| None).unwrap()
    }

    fn client(&self, identity: Option<&[u8]>) -> reqwest::Client {
        let mut builder = reqwest::Client::builder()
            .use_rustls_tls()
            .tls_built_in_root_certs(false)
            .add_root_certificate(reqwest::Certificate::from_pem(self.ca_pem.as_bytes()).unwrap())
            .timeout(Duration::from_secs(60));
        if let Some(pem) = identity {
            builder = builder.identity(reqwest::Identity::from_pem(pem).unwrap());
        }
        builder.build().unwrap()
    }
}

struct Api {
    client: reqwest::Client,
    base: String,
    token: Option<String>,
}

impl Api {
    fn new(client: reqwest::Client, addr: SocketAddr, token: Option<&str>) -> Self {
        Self {
            client,
            base: format!("https://{addr}"),
            token: token.map(str::to_owned),
        }
    }

    fn request(&self, method: reqwest::Method, path: &str) -> reqwest::RequestBuilder {
        let request = self.client.request(method, format!("{}{path}", self.base));
        match &self.token {
            Some(token) => request.bearer_auth(token),
            None => request,
        }
    }

    async fn call<T: DeserializeOwned>(
        &self,
        expected: StatusCode,
        request: reqwest::RequestBuilder,
    ) -> T {
        let response = request.send().await.unwrap();
        let status = response.status();
        let body = response.text().await.unwrap();
        assert_eq!(status, expected, "{body}");
        serde_json::from_str(&body).unwrap_or_else(|e| panic!("{e}: {body}"))
    }

    async fn get<T: DeserializeOwned>(&self, path: &str) -> T {
        self.call(StatusCode::OK, self.request(reqwest::Method::GET, path))
            .await
    }

    async fn post<B: Serialize, T: DeserializeOwned>(
        &self,
        expected: StatusCode,
        path: &str,
        body: &B,
    ) -> T {
        self.call(
            expected,
            self.request(reqwest::Method::POST, path).json(body),
        )
        .await
    }

    async fn job(&self, id: &str) -> JobView {
        self.get(&format!("/v1/jobs/{id}")).await
    }

    /// Waits (up to `secs`) until the job is in `state`; every state it was seen in.
    async fn wait_job(&self, id: &str, state: JobState, secs: u64) -> (JobView, Vec<JobState>) {
        let deadline = tokio::time::Instant::now() + Duration::from_secs(secs);
        let mut seen = Vec::new();
        loop {
            let view = self.job(id).await;
            if seen.last() != Some(&view.state) {
                seen.push(view.state);
            }
            if view.state == state {
                return (view, seen);
            }
            assert!(
                tokio::time::Instant::now() < deadline,
                "job {id} is still {} ({}; Slurm: {:?}), not {state}",
                view.state,
                view.reason,
                view.grid.as_ref().and_then(|g| g.engine_state.clone())
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// The job's whole kept output once complete (waits up to 30 s).
    async fn output(&self, id: &str) -> String {
        let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
        let mut data = Vec::new();
        loop {
            let chunk: LogChunk = self
                .get(&format!(
                    "/v1/jobs/{id}/logs?offset={}&wait=true&timeout=2",
                    data.len()
                ))
                .await;
            data.extend_from_slice(&chunk.data);
            if chunk.complete {
                return String::from_utf8(data).unwrap();
            }
            assert!(
                tokio::time::Instant::now() < deadline,
                "the output of job {id} is not complete within 30 s: {:?}",
                String::from_utf8_lossy(&data)
            );
        }
    }
}

fn gpu(n: u8) -> GpuInfo {
    GpuInfo {
        uuid: GpuUuid::parse(&format!("GPU-11111111-2222-3333-4444-5555555555{n:02}")).unwrap(),
        model: "NVIDIA A100-SXM4-40GB".to_owned(),
        capability: ComputeCapability::new(8, 0),
        memory: MemorySize::from_mib(40_960),
        pci_bus_id: None,
        driver_version: None,
        mig_enabled: false,
        health: GpuHealth::Healthy,
        utilization_percent: None,
        mig_devices: Vec::new(),
        mig_waiting: None,
    }
}

/// Alice's READY image `mymodel:v1`: a session frozen through the agent routes, as a node's
/// agent reports it.
async fn frozen_image(m: &Manager) {
    let node = NodeName::parse("node1").unwrap();
    let register = RegisterNode {
        node: node.clone(),
        agent_version: "test".to_owned(),
        gpu_backend: "simulated".to_owned(),
        gpus: vec![gpu(1)],
        stream_url: None,
        start_modes: Default::default(),
    };
    let _: serde_json::Value = m
        .node
        .post(StatusCode::OK, "/v1/agent/register", &register)
        .await;
    let create = CreateSession {
        name: Some(SessionName::parse("train1").unwrap()),
        gpus: GpuRequest::default(),
        image: None,
        idle_timeout_secs: None,
        max_duration_secs: None,
        reservation: None,
    };
    let session: SessionView = m
        .alice
        .post(StatusCode::CREATED, "/v1/sessions", &create)
        .await;
    let report = |containers, freezes| NodeReport {
        node: node.clone(),
        gpus: vec![gpu(1)],
        containers,
        activity: Vec::new(),
        freezes,
        jobs: Vec::new(),
    };
    let deadline = tokio::time::Instant::now() + Duration::from_secs(15);
    loop {
        let running = vec![ObservedContainer {
            session_id: session.id,
            container_id: format!("c-{}", session.id),
            state: ContainerState::Running,
            error: None,
        }];
        let _: serde_json::Value = m
            .node
            .post(StatusCode::OK, "/v1/agent/sync", &report(running, vec![]))
            .await;
        let view: SessionView = m.alice.get("/v1/sessions/train1").await;
        if view.state == SessionState::Waiting {
            break;
        }
        assert!(tokio::time::Instant::now() < deadline, "{view:?}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let freeze = CreateImage {
        session: SessionName::parse("train1").unwrap(),
        reference: ImageReference::parse("mymodel:v1").unwrap(),
        force: false,
        compression: Default::default(),
    };
    let image: ongrid_core::image::ImageView = m
        .alice
        .post(StatusCode::CREATED, "/v1/images", &freeze)
        .await;
    let done = FreezeProgress::Done {
        image_id: image.id,
        digest: format!("sha256:{DIGEST_HEX}"),
        size: 3,
        sif_path: format!("/store/sha256/{DIGEST_HEX}.sif"),
        docker_image: "ongrid/alice-smith/mymodel:v1".to_owned(),
    };
    let _: serde_json::Value = m
        .node
        .post(
            StatusCode::OK,
            "/v1/agent/sync",
            &report(vec![], vec![done]),
        )
        .await;
}

fn spec(to: &str, command: &str, file: JobSpecFile) -> SubmitJob {
    let spec = JobSpecFile {
        image: Some("mymodel:v1".to_owned()),
        command: vec!["sh".to_owned(), "-c".to_owned(), command.to_owned()],
        target: Some(to.to_owned()),
        ..file
    }
    .validate(Utc::now())
    .unwrap();
    SubmitJob {
        spec,
        reservation: None,
    }
}

async fn submit(m: &Manager, to: &str, command: &str, file: JobSpecFile) -> JobView {
    m.alice
        .post(StatusCode::CREATED, "/v1/jobs", &spec(to, command, file))
        .await
}

fn slurm_id(job: &JobView) -> String {
    job.grid
        .as_ref()
        .and_then(|g| g.engine_id.clone())
        .expect("a Slurm job id, stored before submit answered")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn jobs_run_on_a_real_slurm_and_are_mirrored_back() {
    let cluster = SlurmCluster::start();
    let site = Site::new();
    let config = site.config(&cluster);
    let m = Manager::start(&config, &site).await;
    frozen_image(&m).await;
    let sif = format!("/srv/ongrid/images/sha256/{DIGEST_HEX}.sif");

    // What the site offers Alice, and Bob, who has no local account.
    let targets: Vec<TargetInfo> = m.alice.get("/v1/targets").await;
    let slurm = targets
        .iter()
        .find(|t| t.target == JobTarget::Slurm)
        .unwrap();
    assert_eq!(slurm.account.as_deref(), Some(ACCOUNT));
    assert!(targets
        .iter()
        .any(|t| t.target == JobTarget::Local && t.default));
    let refused: ErrorBody = m
        .bob
        .post(
            StatusCode::FORBIDDEN,
            "/v1/jobs",
            &spec("slurm", "true", JobSpecFile::default()),
        )
        .await;
    assert!(
        refused
            .error
            .message
            .contains("no local account on target slurm"),
        "{}",
        refused.error.message
    );

    // Max duration → Slurm's time limit. Started first: Slurm checks limits every 30 s or so.
    // It ignores SIGUSR1 (sent 10 s before the limit), so Slurm ends it: TIMEOUT.
    let timed = submit(
        &m,
        "slurm",
        "trap '' USR1; echo long; while :; do sleep 1; done",
        JobSpecFile {
            max_duration: Some("1 minute".to_owned()),
            ..JobSpecFile::default()
        },
    )
    .await;
    let timed_id = slurm_id(&timed);
    let limit = cluster.squeue_job(&timed_id).expect("squeue lists it");
    assert_eq!(limit["time_limit"], 1, "{limit}");

    // Submit → RUNNING → FINISHED with its output, through a manager restart.
    let job = submit(
        &m,
        "slurm",
        "echo hello from $ONGRID_JOB_ID restart $ONGRID_RESTART_COUNT; sleep 3; echo done",
        JobSpecFile {
            min_capability: Some("8.0".to_owned()),
            min_gpu_memory: Some("40G".to_owned()),
            ..JobSpecFile::default()
        },
    )
    .await;
    assert_eq!(job.state, JobState::Queued);
    assert_eq!(job.spec.target, Some(JobTarget::Slurm));
    let id = job.id.to_string();
    let engine_id = slurm_id(&job);
    let queued = cluster.squeue_job(&engine_id).expect("squeue lists it");
    assert_eq!(queued["name"], format!("ongrid-{id}"));
    assert_eq!(queued["user_name"], ACCOUNT);
    // Capability 8.0 and 40G: of the cluster's types (a100, t4) only a100 fits: typed.
    let gres = queued["tres_per_node"]
        .as_str()
        .unwrap_or_default()
        .to_owned();
    assert!(gres.contains("gpu:a100:1"), "{queued}");
    let (running, _) = m.alice.wait_job(&id, JobState::Running, 30).await;
    assert!(running
        .reason
        .contains(&format!("started by slurm as its job {engine_id}")));
    m.stop().await;
    let m = Manager::start(&config, &site).await;
    let (finished, _) = m.alice.wait_job(&id, JobState::Finished, 60).await;
    assert_eq!(finished.exit_code, Some(0));
    assert_eq!(
        m.alice.output(&id).await,
        format!("hello from {id} restart 0\ndone\n")
    );
    let call = cluster
        .apptainer_calls()
        .into_iter()
        .find(|c| c.iter().any(|a| a.contains("hello from")))
        .expect("the job ran apptainer");
    assert_eq!(call[..4], ["exec", "--nv", &sif, "sh"]);
    let list: Vec<JobView> = m.alice.get("/v1/jobs").await;
    assert!(list
        .iter()
        .any(|j| j.id == job.id && j.state == JobState::Finished));

    // Halt → SIGUSR1 reaches the job, which exits 123: HALTED. It is restartable, so its chain
    // goes on: the next job is handed to Slurm anew and runs as itself.
    let halted = submit(
        &m,
        "slurm",
        "[ \"$ONGRID_RESTART_COUNT\" = 0 ] || { echo resumed as $ONGRID_JOB_ID restart $ONGRID_RESTART_COUNT; exit 0; }; \
         trap 'echo got USR1; exit 123' USR1; echo waiting; while :; do sleep 0.2; done",
        JobSpecFile {
            restartable: true,
            ..JobSpecFile::default()
        },
    )
    .await;
    let halted_id = halted.id.to_string();
    m.alice.wait_job(&halted_id, JobState::Running, 30).await;
    // Running in Slurm is not yet running the trap: wait for its first line.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    loop {
        let chunk: LogChunk = m.alice.get(&format!("/v1/jobs/{halted_id}/logs")).await;
        if String::from_utf8_lossy(&chunk.data).contains("waiting") {
            break;
        }
        assert!(tokio::time::Instant::now() < deadline);
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let _: JobView = m
        .alice
        .post(StatusCode::OK, &format!("/v1/jobs/{halted_id}/halt"), &())
        .await;
    let (view, seen) = m.alice.wait_job(&halted_id, JobState::Halted, 30).await;
    assert!(seen.contains(&JobState::Halted), "{seen:?}");
    assert_eq!(view.exit_code, Some(123));
    assert!(
        view.reason.contains("exited with code 123 after SIGUSR1"),
        "{}",
        view.reason
    );
    assert!(view.transitions.iter().any(|t| t.to == JobState::Halting));
    let output = m.alice.output(&halted_id).await;
    assert_eq!(output.matches("got USR1").count(), 1, "{output}");
    let resumed_id = view
        .next_job
        .expect("a halted restartable job continues its chain")
        .to_string();
    let (resumed, _) = m.alice.wait_job(&resumed_id, JobState::Finished, 60).await;
    assert_eq!(resumed.chain.restart_count, 1);
    assert_eq!(resumed.previous_job, Some(halted.id));
    assert_ne!(
        slurm_id(&resumed),
        slurm_id(&halted),
        "submitted to Slurm anew"
    );
    assert_eq!(
        m.alice.output(&resumed_id).await,
        format!("resumed as {resumed_id} restart 1\n")
    );

    // Exit 85 → Slurm re-queues it (RequeueExit=85): HALTED, and the chain's next job runs
    // under the same Slurm id with the restart count and its own ONGRID_JOB_ID.
    let checkpoint = submit(
        &m,
        "slurm",
        "echo run $ONGRID_RESTART_COUNT as $ONGRID_JOB_ID; [ \"$ONGRID_RESTART_COUNT\" != 0 ] || exit 85",
        JobSpecFile::default(),
    )
    .await;
    let first_id = checkpoint.id.to_string();
    let checkpoint_engine = slurm_id(&checkpoint);
    let (first, _) = m.alice.wait_job(&first_id, JobState::Halted, 60).await;
    assert!(
        first.reason.contains("code 85 (checkpoint)"),
        "{}",
        first.reason
    );
    let next_id = first
        .next_job
        .expect("re-queued as the next job")
        .to_string();
    let next = m.alice.job(&next_id).await;
    assert_eq!(next.state, JobState::Queued);
    assert_eq!(next.chain.restart_count, 1);
    assert_eq!(slurm_id(&next), checkpoint_engine);
    assert_eq!(
        m.alice.output(&first_id).await,
        format!("run 0 as {first_id}\n")
    );
    // Slurm holds it back (its reason NonZeroExitCode, later BeginTime): it says so in words,
    // and has no place in this site's queue, which it is not in.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(15);
    let waiting = loop {
        let view = m.alice.job(&next_id).await;
        assert_eq!(view.queue_position, None, "{view:?}");
        match view.waiting {
            Some(words) if words.starts_with("waiting in Slurm: ") => break words,
            other => assert!(
                tokio::time::Instant::now() < deadline,
                "job {next_id} waits {other:?} (Slurm: {:?})",
                view.grid.and_then(|g| g.engine_state)
            ),
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    eprintln!("a re-queued Slurm job waits: {waiting}");
    // Slurm waits two minutes before it starts a re-queued job: the admin starts it now.
    cluster.run(
        "scontrol",
        &[
            "update",
            &format!("JobId={checkpoint_engine}"),
            "StartTime=now",
        ],
    );
    m.alice.wait_job(&next_id, JobState::Finished, 60).await;
    assert_eq!(
        m.alice.output(&next_id).await,
        format!("run 1 as {next_id}\n")
    );

    // Cancel → CANCELLED here, and scancel there.
    let cancelled = submit(&m, "slurm", "sleep 300", JobSpecFile::default()).await;
    let cancelled_id = cancelled.id.to_string();
    m.alice.wait_job(&cancelled_id, JobState::Running, 30).await;
    let view: JobView = m
        .alice
        .post(
            StatusCode::OK,
            &format!("/v1/jobs/{cancelled_id}/cancel"),
            &(),
        )
        .await;
    assert_eq!(view.state, JobState::Cancelled);
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    loop {
        let state = cluster
            .squeue_job(&slurm_id(&cancelled))
            .map(|j| j["job_state"].to_string());
        if state.as_deref() == Some("\"CANCELLED\"") {
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "Slurm says {state:?}"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }

    // A request beyond the cluster: refused with Slurm's reason, and kept FAILED with it.
    let refused: ErrorBody = m
        .alice
        .post(
            StatusCode::UNPROCESSABLE_ENTITY,
            "/v1/jobs",
            &spec(
                "slurm",
                "true",
                JobSpecFile {
                    gpus: Some(cluster::GPUS + 2),
                    ..JobSpecFile::default()
                },
            ),
        )
        .await;
    assert!(
        refused.error.message.contains("slurm refused job")
            && refused
                .error
                .message
                .contains("Requested node configuration is not available"),
        "{}",
        refused.error.message
    );
    let list: Vec<JobView> = m.alice.get("/v1/jobs").await;
    let failed = list
        .iter()
        .find(|j| j.state == JobState::Failed)
        .expect("the refused job is kept");
    assert!(
        failed
            .reason
            .contains("refused by slurm: Requested node configuration is not available"),
        "{}",
        failed.reason
    );

    // The time limit passed meanwhile (or does now): HALTED, max duration reached.
    let (timed_view, _) = m
        .alice
        .wait_job(&timed.id.to_string(), JobState::Halted, 150)
        .await;
    assert!(
        timed_view.reason.contains("reached its max duration"),
        "{}",
        timed_view.reason
    );
    let grid = timed_view.grid.unwrap();
    assert!(
        grid.engine_state
            .as_deref()
            .unwrap_or_default()
            .starts_with("TIMEOUT"),
        "{grid:?}"
    );
    // What the README shows: the jobs as the API lists them, and Slurm's completion log.
    let list: Vec<JobView> = m.alice.get("/v1/jobs").await;
    for job in &list {
        let grid = job.grid.as_ref();
        eprintln!(
            "{}  {:<9}  {:<9}  {}",
            job.id,
            job.state.to_string(),
            grid.map_or_else(
                || "-".to_owned(),
                |g| format!("{}:{}", g.target, g.engine_id.as_deref().unwrap_or("-"))
            ),
            job.reason
        );
    }
    eprint!(
        "{}",
        cluster.run(
            "sacct",
            &[
                "-c",
                "--parsable2",
                "--format=JobID,JobName,User,State,ExitCode,NodeList"
            ]
        )
    );
    m.stop().await;
    drop(cluster);
}
