//! The control plane at site scale, by simulation: one real manager (the build's binary, its
//! SQLite store), or two replicas on one PostgreSQL database (`ONGRID_FLEET_STORE=postgres`,
//! each serving half of the agents and of the users), and this process speaking the agent
//! protocol for many simulated nodes at once: each node registers its GPUs, keeps the long-poll
//! of its desired state open, reports the containers of its desired sessions as running at once
//! (no Docker), runs its jobs for a few seconds each (halted at once when the manager asks, with
//! exit code 123 as GPULab's jobs do), and syncs every `sync_interval` and whenever a job ends.
//! As the agent does, each sync but those that report at once what it did on a pushed state
//! reports the activity of the containers that ran at the one before that sampled (CPU and GPU
//! use, busy, so no session is held for idleness).
//! First each user freezes a session into an image (the agent reports the freeze done). Then
//! the users create sessions and submit batch jobs of that image through the API, interleaved
//! (more sessions than GPUs, so some wait, and the sessions halt the jobs in their way), show
//! and list them, then remove a fifth of the sessions so the waiting ones are placed, and at
//! last all of them, so the queued jobs run to their end.
//!
//! It prints what the site-scale targets are about: how long a placement takes to reach its
//! node's agent (from the placement, its STARTING transition's time by the manager's clock, to
//! the long-poll's answer naming it, by the same machine's clock; and from the create request
//! of a session placed while GPUs were free), how many creates answered STARTING, the API's
//! latency for create, show and ls under that load, the scheduling rounds' time (the loop's and
//! those a create runs at once, from the leading manager's `/metrics`; their phases and the
//! creates', from its log), the scrape's time (every 5 s while the work flows, and after the
//! jobs ended) and size, the managers' resident memory (the larger) and the store's size, and
//! the CPU time the managers and the driver itself used (while the work was created, and in
//! all): the driver shares the machine, and the managers' CPU varies less from run to run than
//! latencies.
//!
//! `cargo run --release -p ongrid-e2e --example fleet`, or `bench/run.sh --only fleet`.
//! Sizes from the environment: `ONGRID_FLEET_NODES` (1000), `ONGRID_FLEET_GPUS` (per node, 8),
//! `ONGRID_FLEET_SESSIONS` (10000), `ONGRID_FLEET_JOBS` (20000), `ONGRID_FLEET_USERS` (50),
//! `ONGRID_FLEET_CONCURRENCY` (API requests at once, 32), `ONGRID_FLEET_RATE` (creates and
//! submits a second instead, each sent at its time whether or not those before were answered:
//! the API's latency at that load, where the requests at once measure it with the managers as
//! busy as the driver can keep them; the removals and look-ups stay `ONGRID_FLEET_CONCURRENCY`
//! at once), `ONGRID_FLEET_SYNC` (the manager's `sync_interval` in seconds, 5),
//! `ONGRID_FLEET_STORE` (`sqlite` or `postgres`). Needs a file-descriptor limit above the
//! nodes' count (`ulimit -n`).

use std::collections::{BTreeSet, HashMap, HashSet};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use chrono::{DateTime, Utc};
use futures::StreamExt;
use ongrid_core::api::{
    ContainerState, CreateSession, DesiredState, NodeReport, ObservedContainer, RegisterNode,
    RunState, SessionView,
};
use ongrid_core::holds::ContainerActivity;
use ongrid_core::image::{FreezeProgress, ImageState, ImageView};
use ongrid_core::job::{
    DesiredJob, JobId, JobRun, JobView, LogChunk, ObservedJob, ObservedJobStatus, HALT_EXIT_CODE,
};
use ongrid_core::{
    ComputeCapability, GpuHealth, GpuInfo, GpuRequest, GpuUuid, MemorySize, NodeName, SessionId,
    SessionName,
};
use ongrid_e2e::{bench_summary, cpu_seconds, rss_kib, Site, User};
use reqwest::header::{AUTHORIZATION, ETAG};
use reqwest::StatusCode;
use tokio::sync::watch;

/// How often the simulated agents sync unless `ONGRID_FLEET_SYNC` says otherwise: the manager's
/// `sync_interval`; each agent then follows what the manager tells it, as a real agent does.
const SYNC_INTERVAL: Duration = Duration::from_secs(5);

/// A simulated agent's interval: the desired state's `sync_interval_secs` (at least 1 s), moved
/// by up to a tenth either way at random, as the agent moves it.
fn interval_of(desired: &DesiredState) -> Duration {
    Duration::from_secs(desired.sync_interval_secs.max(1)).mul_f64(rand::random_range(0.9..1.1))
}

/// How long a simulated job runs, at random, unless halted first.
fn job_run_time() -> Duration {
    Duration::from_secs_f64(rand::random_range(2.0..8.0))
}

/// The image every user freezes first and runs their jobs from.
const IMAGE: &str = "fleet:v1";

/// The session each user freezes (not one of the fleet's sessions).
const IMAGE_SESSION: &str = "base";

/// The sizes of one run.
struct Fleet {
    nodes: usize,
    gpus: usize,
    sessions: usize,
    /// Batch jobs submitted beside the sessions.
    jobs: usize,
    users: usize,
    concurrency: usize,
    /// Creates and submits sent at this many a second, each at its time whatever the others'
    /// answers (an open loop, `ONGRID_FLEET_RATE`); `None`: `concurrency` at once, each sent
    /// when one before is answered (a closed loop, as fast as the managers answer).
    rate: Option<f64>,
    /// The manager's `sync_interval`, in seconds (its `node_timeout` is six of them).
    sync_secs: u64,
    /// Two managers on one PostgreSQL database (`ONGRID_FLEET_STORE=postgres`), each serving
    /// half of the agents and of the users; else one on SQLite.
    replicas: bool,
}

impl Fleet {
    /// The store and, at a fixed rate, the rate: what the closing table's rows are named by.
    fn label(&self) -> String {
        match self.rate {
            Some(rate) => format!("{}, {rate} requests a second", self.store()),
            None => self.store().to_owned(),
        }
    }

    /// The store the run's managers share, in words.
    fn store(&self) -> &'static str {
        if self.replicas {
            "two managers on PostgreSQL"
        } else {
            "one manager on SQLite"
        }
    }

    fn from_env() -> Self {
        let size = |name: &str, default: usize| {
            std::env::var(name).map_or(default, |v| {
                v.parse()
                    .unwrap_or_else(|_| panic!("{name}={v}: not a number"))
            })
        };
        Self {
            nodes: size("ONGRID_FLEET_NODES", 1000),
            gpus: size("ONGRID_FLEET_GPUS", 8),
            sessions: size("ONGRID_FLEET_SESSIONS", 10_000),
            jobs: size("ONGRID_FLEET_JOBS", 20_000),
            users: size("ONGRID_FLEET_USERS", 50).max(1),
            concurrency: size("ONGRID_FLEET_CONCURRENCY", 32).max(1),
            rate: std::env::var("ONGRID_FLEET_RATE").ok().map(|v| {
                v.parse::<f64>()
                    .ok()
                    .filter(|rate| rate.is_finite() && *rate >= 0.01)
                    .unwrap_or_else(|| panic!("ONGRID_FLEET_RATE={v}: a number of at least 0.01"))
            }),
            sync_secs: size("ONGRID_FLEET_SYNC", SYNC_INTERVAL.as_secs() as usize).max(1) as u64,
            replicas: match std::env::var("ONGRID_FLEET_STORE").as_deref() {
                Err(_) | Ok("sqlite") => false,
                Ok("postgres") => true,
                Ok(other) => panic!("ONGRID_FLEET_STORE={other}: sqlite or postgres"),
            },
        }
    }
}

/// What the agents and the users record, for the report.
#[derive(Default)]
struct Record {
    /// When each session's create request was sent.
    sent: Mutex<HashMap<SessionId, Instant>>,
    /// Creates that answered STARTING: placed by the round they asked for, within the
    /// manager's `placement_wait`.
    answered_starting: AtomicUsize,
    /// When the first session was removed: the sessions seen before were placed without a GPU
    /// freed for them.
    removals_began: Mutex<Option<Instant>>,
    /// Sessions whose create answered PENDING (no GPU free, or the round placing it still
    /// under way at the answer), by user: their placement's time is looked up once their
    /// agents saw them ([`look_up_placements`]).
    answered_pending: Mutex<Vec<(usize, SessionName, SessionId)>>,
    /// When the manager placed each session the fleet saw placed (the first STARTING
    /// transition's time).
    placed: Mutex<HashMap<SessionId, DateTime<Utc>>>,
    /// When a session first showed in its node's desired state, by this process's monotonic
    /// clock and by the wall clock the manager's placement time is comparable with (one machine).
    seen: Mutex<HashMap<SessionId, (Instant, DateTime<Utc>)>>,
    create: Mutex<Vec<Duration>>,
    /// When a job's submit request was sent.
    job_sent: Mutex<HashMap<JobId, Instant>>,
    /// When a job first showed in its node's desired state, to run.
    job_seen: Mutex<HashMap<JobId, Instant>>,
    /// Jobs whose end (exit, halt or kill) an agent reported.
    job_ended: Mutex<HashSet<JobId>>,
    /// Jobs an agent was asked to halt.
    halted: AtomicUsize,
    submit: Mutex<Vec<Duration>>,
    show: Mutex<Vec<Duration>>,
    list: Mutex<Vec<Duration>>,
    remove: Mutex<Vec<Duration>>,
    /// The scrapes of `/metrics` while the work flows, one every [`SCRAPE_INTERVAL`].
    scrapes: Mutex<Vec<Duration>>,
    syncs: AtomicUsize,
    /// Syncs that reported activity, and the samples they reported.
    sampling_syncs: AtomicUsize,
    samples: AtomicUsize,
    long_polls: AtomicUsize,
    /// Requests that failed or timed out (each retried after a second, or skipped).
    errors: Mutex<Vec<String>>,
}

impl Record {
    fn error(&self, what: String) {
        let mut errors = locked(&self.errors);
        if errors.len() < 1000 {
            errors.push(what);
        }
    }
}

fn main() {
    let fleet = Fleet::from_env();
    let nodes: Vec<(NodeName, String)> = (0..fleet.nodes)
        .map(|i| {
            let name = NodeName::parse(&format!("fleet-{i:05}")).expect("a node name");
            let token = format!(
                "{}{}",
                uuid::Uuid::new_v4().simple(),
                uuid::Uuid::new_v4().simple()
            );
            (name, token)
        })
        .collect();
    let tokens: String = nodes.iter().map(|(n, t)| format!("{n} {t}\n")).collect();
    let sync_interval = format!("\"{} seconds\"", fleet.sync_secs);
    let node_timeout = format!("\"{} seconds\"", fleet.sync_secs * 6);
    let settings = [
        ("sync_interval", sync_interval.as_str()),
        ("node_timeout", node_timeout.as_str()),
    ];
    let mut site = if fleet.replicas {
        Site::start_replicas_only(&settings, "", &tokens)
    } else {
        Site::start_manager_only(&settings, "", &tokens)
    };
    let users: Vec<User> = (0..fleet.users)
        .map(|i| site.user(&format!("fleet{i}")))
        .collect();
    let managers: Vec<String> = [&site.manager_addr, &site.manager2_addr]
        .into_iter()
        .flatten()
        .map(|addr| format!("https://{addr}"))
        .collect();
    let metrics = format!(
        "http://{}/metrics",
        site.metrics_addrs
            .get("manager")
            .expect("the manager's metrics")
    );
    let ca = std::fs::read(site.pki.ca_dir.join("0e2e0e2e.0")).expect("the site's CA");
    let pids: Vec<u32> = ["manager", "manager2"]
        .iter()
        .filter_map(|m| site.pid(m))
        .collect();
    let database = site.dir.path().join("manager.db");
    let pace = match fleet.rate {
        Some(rate) => format!("creates and submits sent at {rate} a second"),
        None => format!("{} API requests at once", fleet.concurrency),
    };
    println!(
        "fleet: {} nodes x {} GPUs, {} sessions and {} jobs from {} users, {pace}, {}",
        fleet.nodes,
        fleet.gpus,
        fleet.sessions,
        fleet.jobs,
        fleet.users,
        fleet.store()
    );
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .expect("a runtime");
    runtime.block_on(run(&fleet, nodes, &users, &managers, &metrics, &ca, &pids));
    match site.postgres_url() {
        Some(url) => println!(
            "store (PostgreSQL, pg_database_size): {}",
            postgres_size(url).map_or_else(|| "-".to_owned(), mib)
        ),
        None => {
            let store_size: u64 = ["", "-wal", "-shm"]
                .iter()
                .filter_map(|ext| std::fs::metadata(format!("{}{ext}", database.display())).ok())
                .map(|m| m.len())
                .sum();
            println!(
                "store (SQLite file, WAL and shared memory): {}",
                mib(store_size)
            );
        }
    }
    manager_phases(&site.dir.path().join("manager.log"));
    drop(site);
}

/// CPU time used, in seconds ([`cpu_seconds`]).
struct Cpu {
    managers: f64,
    driver: f64,
}

impl Cpu {
    fn since(&self, before: &Cpu) -> Cpu {
        Cpu {
            managers: self.managers - before.managers,
            driver: self.driver - before.driver,
        }
    }
}

async fn run(
    fleet: &Fleet,
    nodes: Vec<(NodeName, String)>,
    users: &[User],
    managers: &[String],
    metrics: &str,
    ca: &[u8],
    pids: &[u32],
) {
    let resident = || -> u64 {
        pids.iter()
            .filter_map(|pid| rss_kib(*pid))
            .max()
            .unwrap_or(0)
    };
    // The CPU the managers (together) and this driver have used so far.
    let cpu = || Cpu {
        managers: pids.iter().filter_map(|pid| cpu_seconds(*pid)).sum(),
        driver: cpu_seconds(std::process::id()).unwrap_or(0.0),
    };
    let record = Arc::new(Record::default());
    let (stop, stopped) = watch::channel(false);
    let agents_client = client(ca, None);
    let registered = Arc::new(AtomicUsize::new(0));
    let started = Instant::now();
    let mut agents = Vec::new();
    for (index, (node, token)) in nodes.into_iter().enumerate() {
        let agent = Agent {
            link: Link {
                client: agents_client.clone(),
                manager: managers[index % managers.len()].clone(),
                node,
                authorization: format!("Bearer {token}"),
                record: record.clone(),
            },
            gpus: gpus(index, fleet.gpus),
            jobs: HashMap::new(),
            sampled: BTreeSet::new(),
        };
        let registered = registered.clone();
        let stopped = stopped.clone();
        agents.push(tokio::spawn(async move {
            agent.run(registered, stopped).await;
        }));
    }
    while registered.load(Ordering::Relaxed) < fleet.nodes {
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    println!(
        "{} agents registered in {:.1} s; manager {} resident",
        fleet.nodes,
        started.elapsed().as_secs_f64(),
        kib(resident())
    );

    let clients: Vec<reqwest::Client> = users.iter().map(|user| client(ca, Some(user))).collect();
    let started = Instant::now();
    freeze_images(&clients, managers, &record).await;
    println!(
        "{} images frozen in {:.1} s",
        clients.len(),
        started.elapsed().as_secs_f64()
    );

    // Scraped as Prometheus would, while the work below flows, until the jobs ended.
    let scraper = tokio::spawn(scrape_meanwhile(metrics.to_owned(), record.clone()));
    let started = Instant::now();
    let before = cpu();
    let names = create_work(fleet, &clients, managers, &record).await;
    let took = started.elapsed().as_secs_f64();
    let used = cpu().since(&before);
    println!(
        "{} sessions created and {} jobs submitted in {took:.1} s; CPU meanwhile: managers \
         {:.1} s ({:.2} of a core), this driver {:.1} s ({:.2})",
        names.len(),
        locked(&record.submit).len(),
        used.managers,
        used.managers / took,
        used.driver,
        used.driver / took,
    );
    let placed = fleet.sessions.min(fleet.nodes * fleet.gpus);
    wait_until_seen(&record, placed, Duration::from_secs(120)).await;

    // A fifth of the sessions end: the waiting ones take their GPUs.
    let fifth = fleet.sessions / 5;
    let started = Instant::now();
    *locked(&record.removals_began) = Some(started);
    remove_sessions(fleet, &clients, managers, &record, names[..fifth].to_vec()).await;
    println!(
        "{fifth} sessions removed in {:.1} s",
        started.elapsed().as_secs_f64()
    );
    let placed = fleet.sessions.min(fleet.nodes * fleet.gpus + fifth);
    wait_until_seen(&record, placed, Duration::from_secs(120)).await;
    look_up_placements(fleet, &clients, managers, &record).await;

    // The rest end too: the queued jobs take the GPUs and run to their end.
    let started = Instant::now();
    remove_sessions(fleet, &clients, managers, &record, names[fifth..].to_vec()).await;
    println!(
        "{} sessions removed in {:.1} s",
        names.len() - fifth,
        started.elapsed().as_secs_f64()
    );
    wait_until_jobs_ended(&record, Duration::from_secs(300)).await;
    scraper.abort();

    let scrape = scrape(metrics, 5).await;
    let resident = resident();
    let used = cpu();
    println!(
        "CPU over the whole run: managers {:.1} s, this driver {:.1} s",
        used.managers, used.driver
    );
    let _ = stop.send(true);
    for agent in agents {
        agent.abort();
    }
    report(fleet, &record, &scrape, resident);
    let errors = locked(&record.errors);
    if !errors.is_empty() {
        println!("{} requests failed; the first:", errors.len());
        for error in errors.iter().take(5) {
            println!("  {error}");
        }
    }
}

/// Creates the fleet's sessions and submits its jobs, interleaved evenly, each user in turn:
/// `concurrency` requests at once, or at `rate` a second (each request at its time, however many
/// are still unanswered); every tenth session is shown and at every fiftieth a list is taken.
/// Returns each session's user and name in the order of their creates.
async fn create_work(
    fleet: &Fleet,
    clients: &[reqwest::Client],
    managers: &[String],
    record: &Arc<Record>,
) -> Vec<(usize, SessionName)> {
    let work = Arc::new(Work {
        sessions: fleet.sessions,
        total: fleet.sessions + fleet.jobs,
        clients: clients.to_vec(),
        managers: managers.to_vec(),
        record: record.clone(),
        names: Mutex::new(Vec::new()),
    });
    match fleet.rate {
        Some(rate) => {
            let began = tokio::time::Instant::now();
            let mut most = 0;
            let mut requests = tokio::task::JoinSet::new();
            for i in 0..work.total {
                tokio::time::sleep_until(began + Duration::from_secs_f64(i as f64 / rate)).await;
                // The answered ones taken out, the set holds those still unanswered.
                while let Some(done) = requests.try_join_next() {
                    done.expect("a request");
                }
                let work = work.clone();
                requests.spawn(async move { work.request(i).await });
                most = most.max(requests.len());
            }
            while let Some(done) = requests.join_next().await {
                done.expect("a request");
            }
            println!("at most {most} creates and submits were unanswered at once");
        }
        None => {
            let next = Arc::new(AtomicUsize::new(0));
            let mut workers = Vec::new();
            for _ in 0..fleet.concurrency {
                let (work, next) = (work.clone(), next.clone());
                workers.push(tokio::spawn(async move {
                    loop {
                        let i = next.fetch_add(1, Ordering::Relaxed);
                        if i >= work.total {
                            break;
                        }
                        work.request(i).await;
                    }
                }));
            }
            for worker in workers {
                worker.await.expect("a user worker");
            }
        }
    }
    let mut names = std::mem::take(&mut *locked(&work.names));
    names.sort_by_key(|(k, _, _)| *k);
    names
        .into_iter()
        .map(|(_, user, name)| (user, name))
        .collect()
}

/// The fleet's creates and submits, and the sessions' names as their creates answer.
struct Work {
    sessions: usize,
    /// Sessions and jobs.
    total: usize,
    clients: Vec<reqwest::Client>,
    managers: Vec<String>,
    record: Arc<Record>,
    /// Each created session's place among the sessions, user and name.
    names: Mutex<Vec<(usize, usize, SessionName)>>,
}

impl Work {
    /// Sends request `i` of the work, as user `i % users`: a session's create or a job's
    /// submit.
    async fn request(&self, i: usize) {
        let user = i % self.clients.len();
        let (client, manager) = (
            &self.clients[user],
            &self.managers[user % self.managers.len()],
        );
        // Request i is the k-th session when the sessions' share of the requests up to it grows
        // past k; every other request is a job.
        let k = (i + 1) * self.sessions / self.total;
        if k == i * self.sessions / self.total {
            submit_job(client, manager, &self.record).await;
            return;
        }
        if let Some(name) = create_session(client, manager, &self.record, user, k - 1).await {
            locked(&self.names).push((k - 1, user, name));
        }
    }
}

/// Creates the `k`-th session, `user`'s (shown when `k` is a multiple of 10, with a list taken
/// when of 50); its name, `None` when the create failed (recorded).
async fn create_session(
    client: &reqwest::Client,
    manager: &str,
    record: &Record,
    user: usize,
    k: usize,
) -> Option<SessionName> {
    let body = CreateSession {
        name: None,
        gpus: Default::default(),
        image: None,
        idle_timeout_secs: None,
        max_duration_secs: None,
        reservation: None,
    };
    let url = format!("{manager}/v1/sessions");
    let (sent, text) = post_timed(
        client,
        &url,
        &body,
        record,
        "session create",
        &record.create,
    )
    .await?;
    let view: SessionView = serde_json::from_str(&text).expect("a session");
    // Placed by the round the create asked for (STARTING): the answer says when. A waiting
    // one reaches its node once that round or a later one (GPUs freed) placed it.
    locked(&record.sent).insert(view.id, sent);
    match placed_at(&view) {
        Some(at) if view.state != ongrid_core::SessionState::Pending => {
            record.answered_starting.fetch_add(1, Ordering::Relaxed);
            locked(&record.placed).insert(view.id, at);
        }
        _ => locked(&record.answered_pending).push((user, view.name.clone(), view.id)),
    }
    if k.is_multiple_of(10) {
        let url = format!("{manager}/v1/sessions/{}", view.name);
        get_timed(client, &url, record, "show", &record.show).await;
    }
    if k.is_multiple_of(50) {
        let url = format!("{manager}/v1/sessions");
        get_timed(client, &url, record, "ls", &record.list).await;
    }
    Some(view.name)
}

/// When `session` was placed first (its first STARTING transition).
fn placed_at(session: &SessionView) -> Option<DateTime<Utc>> {
    session
        .transitions
        .iter()
        .find(|t| t.to == ongrid_core::SessionState::Starting)
        .map(|t| t.at)
}

/// Reads the placement time of each session whose create answered PENDING and whose agent saw
/// it since, `concurrency` shows at once between the measured phases (not counted as the API's
/// show latency).
async fn look_up_placements(
    fleet: &Fleet,
    clients: &[reqwest::Client],
    managers: &[String],
    record: &Record,
) {
    let seen = locked(&record.seen).keys().copied().collect::<HashSet<_>>();
    let waiting: Vec<_> = std::mem::take(&mut *locked(&record.answered_pending));
    let (placed, still): (Vec<_>, Vec<_>) = waiting
        .into_iter()
        .partition(|(_, _, id)| seen.contains(id));
    *locked(&record.answered_pending) = still;
    futures::stream::iter(placed)
        .for_each_concurrent(fleet.concurrency, |(user, name, id)| async move {
            let manager = &managers[user % managers.len()];
            let answer = clients[user]
                .get(format!("{manager}/v1/sessions/{name}"))
                .send()
                .await;
            let view = match answer {
                Ok(answer) if answer.status() == StatusCode::OK => {
                    answer.json::<SessionView>().await.ok()
                }
                Ok(answer) => {
                    record.error(format!("show {name}: {}", answer.status()));
                    None
                }
                Err(e) => {
                    record.error(format!("show {name}: {e}"));
                    None
                }
            };
            if let Some(at) = view.filter(|v| v.id == id).as_ref().and_then(placed_at) {
                locked(&record.placed).insert(id, at);
            }
        })
        .await;
}

/// Submits one job of the user's frozen image: one GPU, a command the simulated agent "runs"
/// for a few seconds.
async fn submit_job(client: &reqwest::Client, manager: &str, record: &Record) {
    let body = serde_json::json!({
        "spec": { "image": IMAGE, "command": ["python", "train.py"], "gpus": GpuRequest::default() }
    });
    let url = format!("{manager}/v1/jobs");
    let Some((sent, text)) =
        post_timed(client, &url, &body, record, "job submit", &record.submit).await
    else {
        return;
    };
    let job: JobView = serde_json::from_str(&text).expect("a job");
    locked(&record.job_sent).insert(job.id, sent);
}

/// GETs `url`, its time until the answer's body was in added to `times` when it answered 200
/// (anything else recorded as `what`'s error).
async fn get_timed(
    client: &reqwest::Client,
    url: &str,
    record: &Record,
    what: &str,
    times: &Mutex<Vec<Duration>>,
) {
    let sent = Instant::now();
    match client.get(url).send().await {
        Ok(answer) if answer.status() == StatusCode::OK => {
            let _ = answer.bytes().await;
            locked(times).push(sent.elapsed());
        }
        Ok(answer) => record.error(format!("{what}: {}", answer.status())),
        Err(e) => record.error(format!("{what}: {e}")),
    }
}

/// POSTs `body` to `url`, its time until the answer's body was in added to `times`; when it
/// was sent and the answer's body, `None` when it failed (recorded as `what`'s error).
async fn post_timed(
    client: &reqwest::Client,
    url: &str,
    body: &impl serde::Serialize,
    record: &Record,
    what: &str,
    times: &Mutex<Vec<Duration>>,
) -> Option<(Instant, String)> {
    let sent = Instant::now();
    let answer = match client.post(url).json(body).send().await {
        Ok(answer) => answer,
        Err(e) => {
            record.error(format!("{what}: {e}"));
            return None;
        }
    };
    let status = answer.status();
    let text = answer.text().await.unwrap_or_default();
    locked(times).push(sent.elapsed());
    if !status.is_success() {
        record.error(format!("{what}: {status} {text}"));
        return None;
    }
    Some((sent, text))
}

/// Each user runs a session, freezes it into [`IMAGE`] (the simulated agents report the freeze
/// done at once) and removes the session, all users at once; returns once every image is READY.
async fn freeze_images(clients: &[reqwest::Client], managers: &[String], record: &Record) {
    let freezes = clients.iter().enumerate().map(|(user, client)| {
        let manager = &managers[user % managers.len()];
        async move {
            if let Err(e) = freeze_image(client, manager).await {
                record.error(format!("freeze of user {user}: {e}"));
            }
        }
    });
    futures::future::join_all(freezes).await;
}

async fn freeze_image(client: &reqwest::Client, manager: &str) -> Result<(), String> {
    let body = serde_json::json!({ "name": IMAGE_SESSION });
    let answer = client
        .post(format!("{manager}/v1/sessions"))
        .json(&body)
        .send()
        .await
        .map_err(|e| e.to_string())?;
    if !answer.status().is_success() {
        return Err(format!("session create: {}", answer.status()));
    }
    let running = client
        .get(format!(
            "{manager}/v1/sessions/{IMAGE_SESSION}?wait_for=WAITING&timeout=60"
        ))
        .send()
        .await
        .map_err(|e| e.to_string())?;
    let view: SessionView = running.json().await.map_err(|e| e.to_string())?;
    if view.state != ongrid_core::SessionState::Waiting {
        return Err(format!(
            "session {IMAGE_SESSION} is {:?}, not WAITING",
            view.state
        ));
    }
    let body = serde_json::json!({ "session": IMAGE_SESSION, "reference": IMAGE });
    let answer = client
        .post(format!("{manager}/v1/images"))
        .json(&body)
        .send()
        .await
        .map_err(|e| e.to_string())?;
    if !answer.status().is_success() {
        let status = answer.status();
        return Err(format!(
            "freeze: {status} {}",
            answer.text().await.unwrap_or_default()
        ));
    }
    let started = Instant::now();
    loop {
        // Answered at once when the image is no longer BUILDING, else when its progress moves.
        let image: ImageView = client
            .get(format!("{manager}/v1/images/{IMAGE}?after=0/0&timeout=10"))
            .send()
            .await
            .map_err(|e| e.to_string())?
            .json()
            .await
            .map_err(|e| e.to_string())?;
        match image.state {
            ImageState::Ready => break,
            ImageState::Building if started.elapsed() < Duration::from_secs(60) => {}
            other => return Err(format!("image {IMAGE} is {other:?}: {}", image.reason)),
        }
    }
    let answer = client
        .delete(format!("{manager}/v1/sessions/{IMAGE_SESSION}"))
        .send()
        .await
        .map_err(|e| e.to_string())?;
    if !answer.status().is_success() {
        return Err(format!("session rm: {}", answer.status()));
    }
    Ok(())
}

async fn remove_sessions(
    fleet: &Fleet,
    clients: &[reqwest::Client],
    managers: &[String],
    record: &Arc<Record>,
    ending: Vec<(usize, SessionName)>,
) {
    let ending = Arc::new(Mutex::new(ending));
    let mut workers = Vec::new();
    for _ in 0..fleet.concurrency {
        let (ending, record) = (ending.clone(), record.clone());
        let clients = clients.to_vec();
        let managers = managers.to_vec();
        workers.push(tokio::spawn(async move {
            loop {
                let Some((user, name)) = locked(&ending).pop() else {
                    break;
                };
                let manager = &managers[user % managers.len()];
                let sent = Instant::now();
                let answer = clients[user]
                    .delete(format!("{manager}/v1/sessions/{name}"))
                    .send()
                    .await;
                match answer {
                    Ok(answer) if answer.status().is_success() => {
                        locked(&record.remove).push(sent.elapsed());
                    }
                    Ok(answer) => record.error(format!("rm: {}", answer.status())),
                    Err(e) => record.error(format!("rm: {e}")),
                }
            }
        }));
    }
    for worker in workers {
        worker.await.expect("a user worker");
    }
}

/// Waits until `count` sessions showed in their agents' desired states, or `limit` passed.
async fn wait_until_seen(record: &Record, count: usize, limit: Duration) {
    let started = Instant::now();
    loop {
        let seen = locked(&record.seen).len();
        if seen >= count || started.elapsed() >= limit {
            println!(
                "{seen} of {count} sessions seen by their agents ({:.1} s after the last request)",
                started.elapsed().as_secs_f64()
            );
            return;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Waits until the agents reported the end of every job submitted, or `limit` passed.
async fn wait_until_jobs_ended(record: &Record, limit: Duration) {
    let started = Instant::now();
    let submitted = locked(&record.job_sent).len();
    loop {
        let ended = locked(&record.job_ended).len();
        if ended >= submitted || started.elapsed() >= limit {
            println!(
                "{ended} of {submitted} jobs ended on their nodes, {} of them halted for sessions \
                 ({:.1} s after the last request)",
                record.halted.load(Ordering::Relaxed),
                started.elapsed().as_secs_f64()
            );
            return;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// One simulated node: its agent's side of the protocol, containers simulated.
struct Agent {
    /// How it reaches the manager, shared with its long-poll's task.
    link: Link,
    gpus: Vec<GpuInfo>,
    /// The jobs it was given and still lists, as it runs them.
    jobs: HashMap<JobId, SimulatedJob>,
    /// The containers running at its last sync that sampled activity: the agent samples their
    /// CPU time at each such sync and reports the use of those it sampled before.
    sampled: BTreeSet<SessionId>,
}

/// A desired state and its version from an answer; `None` for 204 (unchanged) and for a
/// refusal (recorded).
async fn read_desired(
    record: &Record,
    node: &NodeName,
    answer: reqwest::Response,
) -> Option<(DesiredState, String)> {
    let status = answer.status();
    if status == StatusCode::NO_CONTENT {
        return None;
    }
    let version = answer
        .headers()
        .get(ETAG)
        .and_then(|v| v.to_str().ok())
        .unwrap_or_default()
        .trim_matches('"')
        .to_owned();
    let text = answer.text().await.unwrap_or_default();
    if !status.is_success() {
        record.error(format!("{}: {status} {text}", node));
        return None;
    }
    let desired: DesiredState = serde_json::from_str(&text).expect("a desired state");
    let now = Instant::now();
    let wall = Utc::now();
    let mut seen = locked(&record.seen);
    for session in &desired.sessions {
        seen.entry(session.session_id).or_insert((now, wall));
    }
    drop(seen);
    let mut seen = locked(&record.job_seen);
    for job in desired.jobs.iter().filter(|j| j.run == JobRun::Run) {
        seen.entry(job.job_id).or_insert(now);
    }
    Some((desired, version))
}

/// How a simulated agent reaches the manager.
#[derive(Clone)]
struct Link {
    client: reqwest::Client,
    manager: String,
    node: NodeName,
    authorization: String,
    record: Arc<Record>,
}

/// How long a long-poll waits, as the agent asks (its `DESIRED_WAIT`).
const DESIRED_WAIT: Duration = Duration::from_secs(25);

/// Keeps the node's long-poll open, as the agent does, and hands each new desired state to the
/// node's loop, until the fleet stops.
async fn watch_desired(
    link: Link,
    pushed: watch::Sender<Option<DesiredState>>,
    mut stopped: watch::Receiver<bool>,
) {
    let mut after = String::new();
    loop {
        let poll = link
            .client
            .get(format!(
                "{}/v1/agent/desired?after={after}&timeout={}",
                link.manager,
                DESIRED_WAIT.as_secs()
            ))
            .header(AUTHORIZATION, &link.authorization)
            .send();
        let answer = tokio::select! {
            answer = poll => answer,
            _ = stopped.changed() => return,
        };
        let answer = match answer {
            Ok(answer) => answer,
            Err(e) => {
                link.record.error(format!("{}: long-poll: {e}", link.node));
                tokio::time::sleep(Duration::from_secs(1)).await;
                continue;
            }
        };
        link.record.long_polls.fetch_add(1, Ordering::Relaxed);
        let status = answer.status();
        match read_desired(&link.record, &link.node, answer).await {
            Some((desired, version)) if version != after => {
                after = version;
                pushed.send_replace(Some(desired));
            }
            Some(_) => {}
            // Unchanged while it waited.
            None if status == StatusCode::NO_CONTENT => {}
            // Refused (recorded): not again at once.
            None => tokio::time::sleep(Duration::from_secs(1)).await,
        }
    }
}

/// A job on a simulated node: started when first seen, ended at `ends` unless halted first.
struct SimulatedJob {
    started_at: DateTime<Utc>,
    ends: Instant,
    /// Its exit, once it ended: reported at every sync while its node still lists it.
    exited: Option<ObservedJobStatus>,
}

impl Agent {
    async fn run(mut self, registered: Arc<AtomicUsize>, mut stopped: watch::Receiver<bool>) {
        let body = RegisterNode {
            node: self.link.node.clone(),
            agent_version: "fleet".to_owned(),
            gpu_backend: "simulated".to_owned(),
            gpus: self.gpus.clone(),
            stream_url: None,
            start_modes: Default::default(),
        };
        let mut desired = loop {
            let answer = self
                .link
                .client
                .post(format!("{}/v1/agent/register", self.link.manager))
                .header(AUTHORIZATION, &self.link.authorization)
                .json(&body)
                .send()
                .await;
            match answer {
                Ok(answer) => {
                    match read_desired(&self.link.record, &self.link.node, answer).await {
                        Some((desired, _)) => break desired,
                        None => self
                            .link
                            .record
                            .error(format!("{}: register answered 204", self.link.node)),
                    }
                }
                Err(e) => self
                    .link
                    .record
                    .error(format!("{}: register: {e}", self.link.node)),
            }
            tokio::time::sleep(Duration::from_secs(1)).await;
        };
        registered.fetch_add(1, Ordering::Relaxed);
        // The long-poll stays open beside the syncs, in a task of its own, as the agent keeps it
        // (`watch_desired` in the node agent): a placement reaches the node whenever it comes.
        let (pushed, mut pushes) = watch::channel(None);
        tokio::spawn(watch_desired(self.link.clone(), pushed, stopped.clone()));
        let mut next_sync = Instant::now() + interval_of(&desired);
        loop {
            if *stopped.borrow() {
                return;
            }
            // A sync at the interval, as soon as a running job ends, and at once when the
            // long-poll brings a desired state that differs from the one it runs: the new
            // containers "start" at once, and so do new jobs; a halt or a kill is done at once.
            let due = self
                .next_job_end()
                .map_or(next_sync, |end| end.min(next_sync));
            // The agent samples its containers' activity at every sync but those that report
            // at once what it did on a pushed state.
            let sampling = tokio::select! {
                () = tokio::time::sleep_until(due.into()) => true,
                pushed = pushes.changed() => {
                    if pushed.is_err() {
                        return;
                    }
                    // The agent reports at once only when it acted on the new state.
                    match pushes.borrow_and_update().clone() {
                        Some(new) if new != desired => desired = new,
                        _ => continue,
                    }
                    false
                }
                _ = stopped.changed() => return,
            };
            if let Some((synced, _)) = self.sync(&desired, sampling).await {
                desired = synced;
            }
            next_sync = Instant::now() + interval_of(&desired);
        }
    }

    /// When the first of its running jobs ends by itself.
    fn next_job_end(&self) -> Option<Instant> {
        self.jobs
            .values()
            .filter(|job| job.exited.is_none())
            .map(|job| job.ends)
            .min()
    }

    /// Reports the desired sessions' containers as running (with their activity when
    /// `sampling`), its freezes done and its jobs as they stand; returns the answer's desired
    /// state (`None` when the sync failed: recorded, and the next sync is the retry).
    async fn sync(
        &mut self,
        desired: &DesiredState,
        sampling: bool,
    ) -> Option<(DesiredState, String)> {
        let jobs = desired.jobs.iter().map(|job| self.observe(job)).collect();
        self.jobs
            .retain(|id, _| desired.jobs.iter().any(|job| job.job_id == *id));
        let containers: BTreeSet<SessionId> = desired
            .sessions
            .iter()
            .filter(|s| s.run == RunState::Running)
            .map(|s| s.session_id)
            .collect();
        let activity = if sampling {
            let sampled = std::mem::replace(&mut self.sampled, containers.clone());
            containers
                .intersection(&sampled)
                .map(|&session_id| ContainerActivity {
                    session_id,
                    sampled_at: Utc::now(),
                    cpu_percent: 35.0,
                    gpu_percent: Some(60.0),
                })
                .collect()
        } else {
            Vec::new()
        };
        if !activity.is_empty() {
            self.link
                .record
                .sampling_syncs
                .fetch_add(1, Ordering::Relaxed);
            let samples = &self.link.record.samples;
            samples.fetch_add(activity.len(), Ordering::Relaxed);
        }
        let report = NodeReport {
            node: self.link.node.clone(),
            gpus: self.gpus.clone(),
            containers: containers
                .into_iter()
                .map(|session_id| ObservedContainer {
                    session_id,
                    container_id: session_id.container_name(),
                    state: ContainerState::Running,
                    error: None,
                })
                .collect(),
            activity,
            freezes: desired.freezes.iter().map(frozen).collect(),
            jobs,
        };
        let answer = self
            .link
            .client
            .post(format!("{}/v1/agent/sync", self.link.manager))
            .header(AUTHORIZATION, &self.link.authorization)
            .json(&report)
            .send()
            .await;
        self.link.record.syncs.fetch_add(1, Ordering::Relaxed);
        match answer {
            Ok(answer) => read_desired(&self.link.record, &self.link.node, answer).await,
            Err(e) => {
                self.link
                    .record
                    .error(format!("{}: sync: {e}", self.link.node));
                None
            }
        }
    }
}

impl Agent {
    /// Where `job` stands: started when first seen, exited when its time is up (code 0), when
    /// asked to halt (code 123, the halt signal's exit) or to be killed.
    fn observe(&mut self, job: &DesiredJob) -> ObservedJob {
        let now = Utc::now();
        let simulated = self.jobs.entry(job.job_id).or_insert_with(|| SimulatedJob {
            started_at: now,
            ends: Instant::now() + job_run_time(),
            exited: None,
        });
        let started_at = simulated.started_at;
        let exit = |exit_code, killed, signalled_at| ObservedJobStatus::Exited {
            started_at,
            finished_at: now,
            exit_code,
            oom_killed: false,
            killed,
            signalled_at,
        };
        let status = match (&simulated.exited, job.run) {
            (Some(exited), _) => exited.clone(),
            (None, JobRun::Run) if Instant::now() < simulated.ends => {
                ObservedJobStatus::Running { started_at }
            }
            (None, JobRun::Run) => exit(0, false, None),
            (None, JobRun::Halt { .. }) => {
                self.link.record.halted.fetch_add(1, Ordering::Relaxed);
                exit(HALT_EXIT_CODE, false, Some(now))
            }
            (None, JobRun::Kill) => exit(137, true, None),
        };
        let log = matches!(status, ObservedJobStatus::Exited { .. }).then(|| {
            if simulated.exited.is_none() {
                simulated.exited = Some(status.clone());
                locked(&self.link.record.job_ended).insert(job.job_id);
            }
            // Its whole output, one line, from where the manager's copy ends.
            let output: &[u8] = b"done\n";
            let from =
                usize::try_from(job.log_offset).map_or(output.len(), |o| o.min(output.len()));
            LogChunk {
                offset: job.log_offset,
                data: output[from..].to_vec(),
                complete: true,
            }
        });
        ObservedJob {
            job_id: job.job_id,
            status,
            log,
        }
    }
}

/// A freeze ordered of a simulated node, done at once: its SIF's digest made up from the
/// image's id (no file is written; nothing in this run reads it).
fn frozen(order: &ongrid_core::image::FreezeOrder) -> FreezeProgress {
    let digest = format!("sha256:{:0>64}", order.image_id.simple());
    FreezeProgress::Done {
        image_id: order.image_id,
        sif_path: format!("sha256/{}.sif", &digest["sha256:".len()..]),
        digest,
        size: 1 << 30,
        docker_image: format!("ongrid-frozen/{}", order.image_id.simple()),
    }
}

/// The simulated GPUs of node `index`: healthy A100s with unique UUIDs.
fn gpus(index: usize, count: usize) -> Vec<GpuInfo> {
    (0..count)
        .map(|g| GpuInfo {
            uuid: GpuUuid::parse(&format!("GPU-{index:08x}-0000-4000-8000-{g:012x}"))
                .expect("a GPU UUID"),
            model: "NVIDIA A100-SXM4-80GB".to_owned(),
            capability: ComputeCapability { major: 8, minor: 0 },
            memory: MemorySize::from_mib(81_920),
            pci_bus_id: Some(format!("00000000:{:02x}:00.0", g + 1)),
            driver_version: Some("550.54.15".to_owned()),
            mig_enabled: false,
            health: GpuHealth::Healthy,
            utilization_percent: Some(0),
            mig_devices: Vec::new(),
            mig_waiting: None,
        })
        .collect()
}

/// An HTTPS client trusting the site's CA, with `user`'s certificate when given.
fn client(ca: &[u8], user: Option<&User>) -> reqwest::Client {
    let mut builder = reqwest::Client::builder()
        .use_rustls_tls()
        .tls_built_in_root_certs(false)
        .add_root_certificate(reqwest::Certificate::from_pem(ca).expect("the CA"))
        .timeout(Duration::from_secs(120));
    if let Some(user) = user {
        let mut pem = std::fs::read(&user.creds.cert).expect("the user's certificate");
        pem.extend(std::fs::read(&user.creds.key).expect("the user's key"));
        builder = builder.identity(reqwest::Identity::from_pem(&pem).expect("an identity"));
    }
    builder.build().expect("a client")
}

/// How often `/metrics` is scraped while the work flows (Prometheus's default is 15 s; more
/// often here, for more samples of a run that lasts minutes).
const SCRAPE_INTERVAL: Duration = Duration::from_secs(5);

/// Scrapes `url` every [`SCRAPE_INTERVAL`] until aborted, each scrape's time (the whole answer
/// read) in `record.scrapes`.
async fn scrape_meanwhile(url: String, record: Arc<Record>) {
    let client = reqwest::Client::new();
    let mut ticks = tokio::time::interval(SCRAPE_INTERVAL);
    ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        ticks.tick().await;
        get_timed(&client, &url, &record, "GET /metrics", &record.scrapes).await;
    }
}

/// The scrape of `/metrics`: each scrape's time, the size, and the round times it shows.
struct Scrape {
    times: Vec<Duration>,
    bytes: usize,
    rounds: u64,
    round_mean: Duration,
    round_p99: Option<f64>,
}

async fn scrape(url: &str, times: usize) -> Scrape {
    let client = reqwest::Client::new();
    let mut scrape = Scrape {
        times: Vec::new(),
        bytes: 0,
        rounds: 0,
        round_mean: Duration::ZERO,
        round_p99: None,
    };
    let mut text = String::new();
    for _ in 0..times {
        let sent = Instant::now();
        text = client
            .get(url)
            .send()
            .await
            .expect("GET /metrics")
            .text()
            .await
            .expect("the metrics");
        scrape.times.push(sent.elapsed());
        scrape.bytes = text.len();
    }
    let value = |name: &str| {
        text.lines()
            .find_map(|line| line.strip_prefix(name)?.strip_prefix(' '))
            .and_then(|v| v.trim().parse::<f64>().ok())
    };
    let sum = value("ongrid_scheduler_round_duration_seconds_sum").unwrap_or(0.0);
    let count = value("ongrid_scheduler_round_duration_seconds_count").unwrap_or(0.0);
    scrape.rounds = count as u64;
    if count > 0.0 {
        scrape.round_mean = Duration::from_secs_f64(sum / count);
        // The smallest bucket bound holding 99% of the rounds.
        scrape.round_p99 = text
            .lines()
            .filter_map(|line| {
                let rest =
                    line.strip_prefix("ongrid_scheduler_round_duration_seconds_bucket{le=\"")?;
                let (bound, rest) = rest.split_once("\"}")?;
                Some((bound.parse::<f64>().ok()?, rest.trim().parse::<f64>().ok()?))
            })
            .find(|(_, n)| *n >= 0.99 * count)
            .map(|(bound, _)| bound);
    }
    scrape
}

fn report(fleet: &Fleet, record: &Record, scrape: &Scrape, resident_kib: u64) {
    let sent = locked(&record.sent);
    let seen = locked(&record.seen);
    // From the placement (its transition's time, taken by the round before its write, so the
    // write is counted in) to the agent's answer: the wake latency, of every placement
    // the fleet saw (those of the creates' rounds and those of the rounds after removals).
    let mut wakes: Vec<Duration> = locked(&record.placed)
        .iter()
        .filter_map(|(id, placed)| {
            let (_, wall) = seen.get(id)?;
            Some((*wall - *placed).to_std().unwrap_or_default())
        })
        .collect();
    // From the create request, its whole answer included, of the sessions placed while GPUs
    // were free (seen before the first removal).
    let removals_began = locked(&record.removals_began).unwrap_or_else(Instant::now);
    let mut create_to_agent: Vec<Duration> = sent
        .iter()
        .filter_map(|(id, sent)| {
            let (seen, _) = seen.get(id)?;
            (*seen < removals_began).then(|| seen.saturating_duration_since(*sent))
        })
        .collect();
    let job_sent = locked(&record.job_sent);
    let job_seen = locked(&record.job_seen);
    let mut job_starts: Vec<Duration> = job_sent
        .iter()
        .filter_map(|(id, sent)| Some(job_seen.get(id)?.saturating_duration_since(*sent)))
        .collect();
    println!();
    println!(
        "fleet of {} nodes x {} GPUs, {} sessions and {} jobs; {} syncs ({} of them with {} \
         activity samples) and {} long-poll answers",
        fleet.nodes,
        fleet.gpus,
        fleet.sessions,
        fleet.jobs,
        record.syncs.load(Ordering::Relaxed),
        record.sampling_syncs.load(Ordering::Relaxed),
        record.samples.load(Ordering::Relaxed),
        record.long_polls.load(Ordering::Relaxed)
    );
    println!("{:<44} {:>10} {:>10}   target", "", "p50", "p99");
    let line = |what: &str, values: &mut Vec<Duration>, target: &str| {
        let (p50, p99) = percentiles(values);
        println!("{what:<44} {:>10} {:>10}   {target}", ms(p50), ms(p99));
        bench_summary(
            &format!("fleet ({}) {what}", fleet.label()),
            &format!("p50 {} / p99 {}", ms(p50), ms(p99)),
            target,
            None,
        );
    };
    line("placement, to its agent", &mut wakes, "p99 < 250 ms");
    line(
        "create request sent, to its agent (GPUs free)",
        &mut create_to_agent,
        "-",
    );
    println!(
        "{:<44} {} of {} STARTING (the rest PENDING: no GPU free, or placed after the answer)",
        "create answers",
        record.answered_starting.load(Ordering::Relaxed),
        sent.len()
    );
    line("API create", &mut locked(&record.create), "p99 < 100 ms");
    line("API show", &mut locked(&record.show), "p99 < 100 ms");
    line("API ls", &mut locked(&record.list), "p99 < 100 ms");
    line("API rm", &mut locked(&record.remove), "-");
    line("API job submit", &mut locked(&record.submit), "-");
    line(
        "job submitted, to its agent (queue included)",
        &mut job_starts,
        "-",
    );
    line(
        "/metrics scrape, while the work flows",
        &mut locked(&record.scrapes),
        "< 100 ms",
    );
    line(
        "/metrics scrape, after the jobs ended",
        &mut scrape.times.clone(),
        "< 100 ms",
    );
    println!(
        "{:<44} mean {} over {} rounds, p99 <= {} s   target < 250 ms",
        "scheduling round",
        ms(scrape.round_mean),
        scrape.rounds,
        scrape
            .round_p99
            .map_or_else(|| "-".to_owned(), |b| format!("{b}"))
    );
    println!(
        "{:<44} {}",
        "/metrics size",
        kib(scrape.bytes as u64 / 1024)
    );
    println!(
        "{:<44} {}   target < 1 GiB",
        "manager resident memory",
        kib(resident_kib)
    );
    bench_summary(
        &format!("fleet ({}) manager memory", fleet.label()),
        &kib(resident_kib),
        "< 1 GiB",
        None,
    );
}

/// The size of the PostgreSQL database at `url`, by `psql` (Debian's postgresql-client).
fn postgres_size(url: &str) -> Option<u64> {
    let output = std::process::Command::new("psql")
        .arg(url)
        .args(["-At", "-c", "SELECT pg_database_size(current_database())"])
        .output()
        .ok()?;
    String::from_utf8_lossy(&output.stdout).trim().parse().ok()
}

/// Where the loop's rounds spent their time, from the manager's DEBUG lines "Round's phases
/// timed." (`site_ms`, `phases_ms`, `input_ms`, `plan_ms`, `write_ms`: the plan and its write
/// were `apply_ms` together), over the rounds that planned something; and the creates', from
/// "Create's phases timed." (`checks_ms`, `write_ms`, `wait_ms`, `read_ms`; the whole request is
/// the API create line, timed by this driver): the mean, the 99th percentile and the largest of
/// each. `log` is the first manager's: with two, its rounds while it leads and the creates it
/// answered.
fn manager_phases(log: &std::path::Path) {
    let Ok(text) = std::fs::read_to_string(log) else {
        return;
    };
    logged_phases(
        &text,
        "Round's phases timed.",
        "rounds that planned",
        &["site_ms", "phases_ms", "input_ms", "plan_ms", "write_ms"],
    );
    logged_phases(
        &text,
        "Create's phases timed.",
        "creates",
        &["checks_ms", "write_ms", "wait_ms", "read_ms"],
    );
}

/// The mean, the 99th percentile and the largest of each of `phases` over the log's lines
/// holding `message` (of the manager whose log it is: with two, the first one's), each over the
/// lines that hold it.
fn logged_phases(text: &str, message: &str, what: &str, phases: &[&str]) {
    let mut values: Vec<Vec<f64>> = vec![Vec::new(); phases.len()];
    for line in text.lines().filter(|l| l.contains(message)) {
        for field in line.split_whitespace() {
            let Some((key, value)) = field.split_once('=') else {
                continue;
            };
            let (Some(i), Ok(value)) =
                (phases.iter().position(|p| *p == key), value.parse::<f64>())
            else {
                continue;
            };
            values[i].push(value);
        }
    }
    let count = values.iter().map(Vec::len).max().unwrap_or(0);
    if count == 0 {
        return;
    }
    println!("{what} ({count}), mean / p99 / highest:");
    for (phase, values) in phases.iter().zip(&mut values) {
        if values.is_empty() {
            println!("  {phase:<10} not logged");
            continue;
        }
        values.sort_by(f64::total_cmp);
        let mean = values.iter().sum::<f64>() / values.len() as f64;
        let p99 = values[((values.len() - 1) as f64 * 0.99).round() as usize];
        let highest = values.last().copied().unwrap_or_default();
        println!("  {phase:<10} {mean:>8.1} / {p99:>8.1} / {highest:>8.1} ms");
    }
}

/// The value behind `mutex` (a panicking holder leaves it as it was: the record is still
/// worth reporting).
fn locked<T>(mutex: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    mutex
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

fn percentiles(values: &mut [Duration]) -> (Duration, Duration) {
    if values.is_empty() {
        return (Duration::ZERO, Duration::ZERO);
    }
    values.sort();
    let at = |q: f64| values[((values.len() - 1) as f64 * q).round() as usize];
    (at(0.5), at(0.99))
}

fn ms(d: Duration) -> String {
    format!("{:.1} ms", d.as_secs_f64() * 1000.0)
}

fn kib(k: u64) -> String {
    format!("{:.1} MiB", k as f64 / 1024.0)
}

fn mib(bytes: u64) -> String {
    format!("{:.1} MiB", bytes as f64 / 1024.0 / 1024.0)
}
