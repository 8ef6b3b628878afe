//! `devctl admin node ls|drain|undrain|rm`: the site's nodes as an admin runs them.
//!
//! - `ls` (`GET /v1/nodes`): one row per node: state, GPUs, what runs there, agent, last sync;
//!   then why drained nodes are drained and which GPUs wait to drain for a MIG change.
//! - `drain NODE [--reason TEXT] [--wait]` (`POST /v1/nodes/{name}/drain`): nothing new is
//!   placed on the node; running sessions and jobs keep running. `--wait` then asks
//!   `GET /v1/nodes/{name}?wait_empty=true` (answered when the node empties, or after a minute)
//!   until nothing holds the node's GPUs.
//! - `undrain NODE` (`DELETE /v1/nodes/{name}/drain`): back in service.
//! - `rm NODE` (`DELETE /v1/nodes/{name}`): forget a node whose agent is stopped and on which
//!   nothing is left; its agent registering again brings it back.
//! - `owner NODE GROUP|--clear` (`PUT|DELETE /v1/nodes/{name}/owner`): the owner group of all
//!   the node's GPUs (a GPU's own owner wins).

use std::future::Future;
use std::time::Duration;

use clap::{Args, Subcommand};
use ongrid_core::api::{DrainRequest, NodeView};
use ongrid_core::{HumanDuration, NodeName};

use crate::client::{Client, ClientError};
use crate::format::format_time;
use crate::table::Table;
use crate::terminal::{JsonArgs, Terminal};

#[derive(Debug, Subcommand)]
pub enum NodeCommand {
    /// List nodes: state, GPUs, running sessions and jobs, agent version, last sync
    Ls(JsonArgs),
    /// Place nothing new on a node; running sessions and jobs keep running
    Drain(DrainArgs),
    /// Put a drained node back in service
    Undrain(NodeArgs),
    /// Forget a node whose agent is stopped and that has no sessions or jobs left
    Rm(NodeArgs),
    /// Give all of a node's GPUs an owner group (see devctl admin gpu owner); --clear takes it
    /// away
    Owner(NodeOwnerArgs),
}

#[derive(Debug, Clone, Args)]
pub struct NodeOwnerArgs {
    /// The node's name, as `devctl admin node ls` shows it
    pub node: NodeName,
    /// The owner group (an accounting group, as devctl share lists them)
    #[arg(required_unless_present = "clear", conflicts_with = "clear")]
    pub group: Option<String>,
    /// Take the owner away
    #[arg(long)]
    pub clear: bool,
    #[command(flatten)]
    pub output: JsonArgs,
}

#[derive(Debug, Clone, Args)]
pub struct NodeArgs {
    /// The node's name, as `devctl admin node ls` shows it
    pub node: NodeName,
    #[command(flatten)]
    pub output: JsonArgs,
}

#[derive(Debug, Clone, Args)]
pub struct DrainArgs {
    /// The node's name, as `devctl admin node ls` shows it
    pub node: NodeName,
    /// Why, for the people whose work is there (default: maintenance)
    #[arg(long)]
    pub reason: Option<String>,
    /// Wait until no session or job holds the node's GPUs any more
    #[arg(long)]
    pub wait: bool,
    /// How long --wait waits, like 30m or "2 hours"
    #[arg(long, default_value = "1h", requires = "wait", value_name = "DURATION")]
    pub timeout: HumanDuration,
    #[command(flatten)]
    pub output: JsonArgs,
}

pub async fn run(
    command: NodeCommand,
    client: &Client,
    term: &mut Terminal<'_>,
) -> anyhow::Result<()> {
    match command {
        NodeCommand::Ls(output) => {
            let nodes: Vec<NodeView> = client.get("v1/nodes").send().await?;
            let width = term.width;
            term.show(output.json, &nodes, |nodes| render_list(nodes, width))
        }
        NodeCommand::Drain(args) => {
            let body = DrainRequest {
                reason: args.reason.clone(),
            };
            let mut node: NodeView = client
                .post(&format!("v1/nodes/{}/drain", args.node))
                .json(&body)
                .send()
                .await?;
            if args.wait {
                let name = args.node.clone();
                let fetch = |wait: u64| {
                    client
                        .get(&format!("v1/nodes/{name}"))
                        .query(&[("wait_empty", "true"), ("timeout", &wait.to_string())])
                        .send()
                };
                node = wait_until_empty(node, args.timeout, fetch, |text| term.note(text)).await?;
            }
            term.show(args.output.json, &node, render_drained)
        }
        NodeCommand::Undrain(NodeArgs { node, output }) => {
            let node: NodeView = client
                .delete(&format!("v1/nodes/{node}/drain"))
                .send()
                .await?;
            term.show(output.json, &node, |node| {
                format!("node {} is back in service\n", node.name)
            })
        }
        NodeCommand::Owner(NodeOwnerArgs {
            node,
            group,
            clear: _,
            output,
        }) => {
            let path = format!("v1/nodes/{node}/owner");
            let view: ongrid_core::reservation::OwnerView = match group {
                Some(group) => {
                    let body = ongrid_core::reservation::SetOwner { group };
                    client.put(&path).json(&body).send().await?
                }
                None => client.delete(&path).send().await?,
            };
            term.show(output.json, &view, super::reservation::render_owner)
        }
        NodeCommand::Rm(NodeArgs { node, output }) => {
            let node: NodeView = client.delete(&format!("v1/nodes/{node}")).send().await?;
            term.show(output.json, &node, |node| {
                format!(
                    "node {} removed; its agent registering again brings it back\n",
                    node.name
                )
            })
        }
    }
}

/// Asks `fetch` (the manager's `wait_empty` answer, which waits up to the given seconds), until
/// nothing holds the node's GPUs or `timeout` passes; says through `note` what it waits for
/// whenever that changes. Uses tokio's clock, so tests run it with paused time.
async fn wait_until_empty<F, Fut>(
    mut node: NodeView,
    timeout: HumanDuration,
    mut fetch: F,
    mut note: impl FnMut(&str),
) -> anyhow::Result<NodeView>
where
    F: FnMut(u64) -> Fut,
    Fut: Future<Output = Result<NodeView, ClientError>>,
{
    let deadline = tokio::time::Instant::now() + timeout.as_duration();
    let mut said = None;
    while !is_empty(&node) {
        let left = what_is_left(&node);
        if said.as_ref() != Some(&left) {
            note(&format!("waiting for {left} on {} to end", node.name));
            said = Some(left);
        }
        let now = tokio::time::Instant::now();
        if now >= deadline {
            anyhow::bail!(
                "node {} still has {} after {timeout}; it stays drained (see devctl admin node ls, \
                 and devctl session ls --all and devctl job ls --all for what runs there)",
                node.name,
                what_is_left(&node)
            );
        }
        let wait = (deadline - now).as_secs().clamp(1, 60);
        // The manager answers at once when the node empties, else after `wait` seconds.
        let asked = tokio::time::Instant::now();
        node = fetch(wait).await?;
        if !is_empty(&node) && asked.elapsed() < Duration::from_secs(1) {
            // An answer before its time that still is not empty: do not ask in a loop.
            tokio::time::sleep(Duration::from_secs(1)).await;
        }
    }
    Ok(node)
}

fn is_empty(node: &NodeView) -> bool {
    node.sessions == 0 && node.jobs == 0
}

/// `2 sessions and 1 job`.
fn what_is_left(node: &NodeView) -> String {
    let plural = |n: u32, what: &str| format!("{n} {what}{}", if n == 1 { "" } else { "s" });
    match (node.sessions, node.jobs) {
        (s, 0) => plural(s, "session"),
        (0, j) => plural(j, "job"),
        (s, j) => format!("{} and {}", plural(s, "session"), plural(j, "job")),
    }
}

/// `devctl admin node drain`: the node after the drain.
pub fn render_drained(node: &NodeView) -> String {
    let drain = node
        .drain
        .as_ref()
        .map_or_else(|| "drained".to_owned(), |d| d.sentence());
    if is_empty(node) {
        format!("node {} {drain}; nothing runs there\n", node.name)
    } else {
        let verb = if node.sessions + node.jobs == 1 {
            "keeps"
        } else {
            "keep"
        };
        format!(
            "node {} {drain}; {} {verb} running there\n",
            node.name,
            what_is_left(node)
        )
    }
}

/// The node's state in one word or two: `online`, `offline`, `online, drained`.
fn state(node: &NodeView) -> String {
    let online = if node.online { "online" } else { "offline" };
    match node.drain {
        Some(_) => format!("{online}, drained"),
        None => online.to_owned(),
    }
}

/// `4` or `4 (1 drained, 1 failed, 1 waiting to drain)`.
fn gpus(node: &NodeView) -> String {
    let drained = node.gpus.iter().filter(|g| g.drain.is_some()).count();
    let failed = node
        .gpus
        .iter()
        .filter(|g| !g.info.health.is_healthy())
        .count();
    let mut notes = Vec::new();
    if drained > 0 {
        notes.push(format!("{drained} drained"));
    }
    if failed > 0 {
        notes.push(format!("{failed} failed"));
    }
    let waiting = node
        .gpus
        .iter()
        .filter(|g| g.info.mig_waiting.is_some())
        .count();
    if waiting > 0 {
        notes.push(format!("{waiting} waiting to drain"));
    }
    if notes.is_empty() {
        node.gpus.len().to_string()
    } else {
        format!("{} ({})", node.gpus.len(), notes.join(", "))
    }
}

/// `devctl admin node ls`: one row per node, then why drained nodes are drained.
pub fn render_list(nodes: &[NodeView], width: Option<u16>) -> String {
    if nodes.is_empty() {
        return "no nodes: no node agent has registered with the manager yet\n".to_owned();
    }
    let mut table = Table::new(&[
        "NODE",
        "STATE",
        "GPUS",
        "SESSIONS",
        "JOBS",
        "BACKEND",
        "AGENT",
        "LAST SEEN",
    ]);
    table.keep_whole(&[0, 1, 7]);
    for node in nodes {
        table.row([
            node.name.to_string(),
            state(node),
            gpus(node),
            node.sessions.to_string(),
            node.jobs.to_string(),
            node.gpu_backend.clone(),
            node.agent_version.clone(),
            format_time(node.last_seen),
        ]);
    }
    let mut text = table.render(width, "");
    for node in nodes {
        if let Some(drain) = &node.drain {
            text.push_str(&format!("{}: {}\n", node.name, drain.sentence()));
        }
        for gpu in &node.gpus {
            if let Some(change) = gpu.info.mig_waiting {
                text.push_str(&format!(
                    "{}: GPU {} waits to drain for {change}: nothing new is placed on it, and \
                     its agent makes the change once no session or job uses it\n",
                    node.name, gpu.info.uuid
                ));
            }
        }
    }
    text
}

#[cfg(test)]
mod tests {
    use super::*;
    use chrono::DateTime;
    use ongrid_core::gpu::Drain;

    fn node(sessions: u32, jobs: u32, drain: Option<Drain>) -> NodeView {
        NodeView {
            name: NodeName::parse("node1").unwrap(),
            online: true,
            last_seen: DateTime::from_timestamp(1_795_255_200, 0).unwrap(),
            gpu_backend: "nvidia-smi".into(),
            gpus: vec![],
            agent_version: "0.1.0".into(),
            drain,
            sessions,
            jobs,
        }
    }

    fn drain() -> Drain {
        Drain {
            reason: "new PSU".into(),
            since: DateTime::from_timestamp(1_795_255_200, 0).unwrap(),
            by: "alice".into(),
        }
    }

    #[test]
    fn a_drain_says_what_keeps_running() {
        assert_eq!(
            render_drained(&node(2, 1, Some(drain()))),
            "node node1 drained 2026-11-21 10:00 UTC by alice: new PSU; 2 sessions and 1 job \
             keep running there\n"
        );
        assert_eq!(
            render_drained(&node(0, 0, Some(drain()))),
            "node node1 drained 2026-11-21 10:00 UTC by alice: new PSU; nothing runs there\n"
        );
        assert_eq!(what_is_left(&node(1, 0, None)), "1 session");
        assert_eq!(what_is_left(&node(0, 3, None)), "3 jobs");
    }

    #[tokio::test(start_paused = true)]
    async fn drain_wait_asks_until_the_node_is_empty_and_says_what_it_waits_for() {
        let answers = std::sync::Mutex::new(vec![node(0, 0, None), node(1, 0, None)]);
        let asked = std::sync::Mutex::new(Vec::new());
        let mut notes = Vec::new();
        let fetch = |wait: u64| {
            asked.lock().unwrap().push(wait);
            let answer = answers.lock().unwrap().pop().unwrap();
            async move { Ok(answer) }
        };
        let timeout = HumanDuration::parse("10m").unwrap();
        let done = wait_until_empty(node(2, 1, None), timeout, fetch, |t| {
            notes.push(t.to_owned())
        })
        .await
        .unwrap();
        assert!(is_empty(&done));
        assert_eq!(*asked.lock().unwrap(), [60, 60]);
        assert_eq!(
            notes,
            [
                "waiting for 2 sessions and 1 job on node1 to end",
                "waiting for 1 session on node1 to end"
            ]
        );
    }

    #[tokio::test(start_paused = true)]
    async fn drain_wait_gives_up_after_its_timeout_saying_what_is_left() {
        let fetch = |wait: u64| async move {
            tokio::time::sleep(Duration::from_secs(wait)).await;
            Ok(node(1, 1, None))
        };
        let timeout = HumanDuration::parse("90s").unwrap();
        let start = tokio::time::Instant::now();
        let error = wait_until_empty(node(1, 1, None), timeout, fetch, |_| {})
            .await
            .unwrap_err();
        assert_eq!(start.elapsed(), Duration::from_secs(90));
        assert!(
            error
                .to_string()
                .starts_with("node node1 still has 1 session and 1 job after 1 minute 30 seconds; it stays drained"),
            "{error}"
        );
    }

    #[test]
    fn the_list_says_which_gpus_wait_to_drain_for_a_mig_change() {
        use ongrid_core::api::GpuView;
        use ongrid_core::{ComputeCapability, GpuHealth, GpuInfo, GpuMode, GpuUuid, MemorySize};
        let gpu = |n: u8, waiting: Option<ongrid_core::MigChange>| GpuView {
            info: GpuInfo {
                uuid: GpuUuid::parse(&format!("GPU-5c89852c-d268-c3f3-1b07-005d5ae1dc{n:02}"))
                    .unwrap(),
                model: "NVIDIA A100-SXM4-80GB".into(),
                capability: ComputeCapability::new(8, 0),
                memory: MemorySize::from_mib(81_920),
                pci_bus_id: None,
                driver_version: None,
                mig_enabled: true,
                health: GpuHealth::Healthy,
                utilization_percent: None,
                mig_devices: Vec::new(),
                mig_waiting: waiting,
            },
            node: NodeName::parse("node1").unwrap(),
            mode: GpuMode::Exclusive,
            used: 1,
            free: 0,
            sessions: vec![],
            drain: None,
            mig_sessions: Default::default(),
        };
        let mut view = node(1, 1, None);
        view.gpus = vec![
            gpu(1, Some(ongrid_core::MigChange::Off)),
            gpu(
                2,
                Some(
                    "1g.10gb*7"
                        .parse()
                        .map(ongrid_core::MigChange::Layout)
                        .unwrap(),
                ),
            ),
            gpu(3, None),
        ];
        let text = render_list(&[view], None);
        assert_eq!(
            text,
            "NODE   STATE   GPUS                    SESSIONS  JOBS  BACKEND     AGENT  LAST SEEN\n\
             node1  online  3 (2 waiting to drain)  1         1     nvidia-smi  0.1.0  2026-11-21 10:00:00Z\n\
             node1: GPU GPU-5c89852c-d268-c3f3-1b07-005d5ae1dc01 waits to drain for MIG mode off: \
             nothing new is placed on it, and its agent makes the change once no session or job \
             uses it\n\
             node1: GPU GPU-5c89852c-d268-c3f3-1b07-005d5ae1dc02 waits to drain for MIG layout \
             1g.10gb*7: nothing new is placed on it, and its agent makes the change once no \
             session or job uses it\n"
        );
    }

    #[test]
    fn the_list_shows_state_and_why_drained() {
        let text = render_list(&[node(1, 0, Some(drain()))], None);
        assert_eq!(
            text,
            "NODE   STATE            GPUS  SESSIONS  JOBS  BACKEND     AGENT  LAST SEEN\n\
             node1  online, drained  0     1         0     nvidia-smi  0.1.0  2026-11-21 10:00:00Z\n\
             node1: drained 2026-11-21 10:00 UTC by alice: new PSU\n"
        );
    }
}
