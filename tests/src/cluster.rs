//! Several nodes on one machine: the manager and the gateway of a [`Site`] in the host's network
//! namespace, and one agent per [`Node`], each in its own network namespace with its own address
//! (`10.77.N.11`, `.12`, ... on a veth pair whose host ends share a bridge holding `10.77.N.1`,
//! where the manager listens), its own stream endpoint (`wss://<its address>:8444`, with a
//! certificate for that address), its own token and simulated GPUs.
//!
//! The agents share the machine's Docker daemon, and so its network namespace, where Docker's
//! bridges and iptables chains live. Each agent's firewall rules therefore go through a wrapper
//! (`[network] iptables`) that runs iptables in the namespace of this test process, the host's:
//! what a node's own iptables would be. Containers, networks and rules are kept apart by node
//! name, as on one Docker they always are.
//!
//! Dropping a [`Cluster`] kills the agents and removes, pass or fail, their containers,
//! networks and firewall chains, the namespaces, the veth pairs and the bridge; the [`Site`]
//! then stops the gateway and the manager.

use std::net::Ipv4Addr;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use rcgen::{CertificateParams, ExtendedKeyUsagePurpose, KeyUsagePurpose, SanType};
use serde_json::Value;

use crate::{
    binary, grid_dn, remove_docker_objects, remove_firewall_chains, terminate, Process, SimGpu,
    Site,
};

/// The port of every agent's stream endpoint: each has its own namespace, so they never clash.
pub const STREAM_PORT: u16 = 8444;

/// One node: its agent's network namespace, address and name.
pub struct Node {
    /// `e2e-<suffix>-<letter>`.
    pub name: String,
    /// The network namespace, `ongrid-<suffix>-<letter>` (under `/run/netns/`).
    pub netns: String,
    pub address: Ipv4Addr,
    pub gpus: Vec<SimGpu>,
    letter: char,
    agent: Option<Process>,
}

impl Node {
    /// The UUIDs of this node's simulated GPUs.
    pub fn gpu_uuids(&self) -> Vec<String> {
        self.gpus.iter().map(|g| g.uuid.clone()).collect()
    }
}

/// A site whose agents run as separate hosts; see the module's documentation.
pub struct Cluster {
    pub site: Site,
    pub nodes: Vec<Node>,
    /// Dropped after the site: the namespaces and the bridge outlive every process.
    network: HostNetwork,
}

impl Cluster {
    /// A manager (with `manager_extra` appended to its config, and `node_timeout`), a gateway,
    /// and one agent per entry of `nodes` (its simulated GPUs), all started and online.
    pub fn start(nodes: &[Vec<SimGpu>], node_timeout: &str, manager_extra: &str) -> Self {
        crate::require_docker();
        let site = Site::prepare(&[]).expect("prepare the site's files");
        let network =
            HostNetwork::create(&site.suffix, nodes.len()).expect("make the nodes' namespaces");
        let mut cluster = Self {
            nodes: nodes
                .iter()
                .enumerate()
                .map(|(i, gpus)| {
                    let letter = char::from(b'a' + u8::try_from(i).expect("a few nodes"));
                    Node {
                        name: format!("e2e-{}-{letter}", site.suffix),
                        netns: network.netns[i].clone(),
                        address: network.node_address(i),
                        gpus: gpus.clone(),
                        letter,
                        agent: None,
                    }
                })
                .collect(),
            site,
            network,
        };
        cluster
            .write_files(node_timeout, manager_extra)
            .expect("write the cluster's configs");
        cluster.site.start_manager();
        for i in 0..cluster.nodes.len() {
            cluster.start_agent(i);
        }
        cluster.wait_for_nodes();
        cluster.site.start_gateway();
        cluster
    }

    /// The manager's certificate for its bridge address too, one token, certificate, GPU file
    /// and config per agent, the iptables wrappers, and the manager's config.
    fn write_files(&mut self, node_timeout: &str, manager_extra: &str) -> anyhow::Result<()> {
        let dir = self.site.dir.path().to_path_buf();
        let host = self.network.host_address();
        issue_server(&self.site, "manager", &[Ipv4Addr::LOCALHOST, host])?;

        let config = dir.join("manager.toml");
        let text = std::fs::read_to_string(&config)?
            .replace(
                "listen = \"127.0.0.1:0\"",
                &format!("listen = \"{host}:0\""),
            )
            .replace(
                "node_timeout = \"10 seconds\"",
                &format!("node_timeout = \"{node_timeout}\""),
            );
        std::fs::write(&config, format!("{text}\n{manager_extra}\n"))?;

        // iptables in the host's namespace, where the shared Docker's bridges and chains are.
        let wrappers = dir.join("host-iptables");
        std::fs::create_dir_all(&wrappers)?;
        let host_netns = format!("/proc/{}/ns/net", std::process::id());
        for program in ["iptables", "iptables-restore"] {
            let path = wrappers.join(program);
            std::fs::write(
                &path,
                format!("#!/bin/sh\nexec nsenter --net={host_netns} /usr/sbin/{program} \"$@\"\n"),
            )?;
            Command::new("chmod").arg("755").arg(&path).status()?;
        }

        let mut tokens = String::new();
        for node in &self.nodes {
            let letter = node.letter;
            let token = format!("token-{}", uuid::Uuid::new_v4().simple());
            tokens.push_str(&format!("{} {token}\n", node.name));
            std::fs::write(
                dir.join(format!("node-token-{letter}")),
                format!("{token}\n"),
            )?;
            issue_server(&self.site, &format!("agent-{letter}"), &[node.address])?;
            let mut gpus = String::new();
            for gpu in &node.gpus {
                gpus.push_str(&format!(
                    "[[gpu]]\nuuid = \"{}\"\nmodel = \"{}\"\ncapability = \"{}\"\nmemory = \"{}\"\n\n",
                    gpu.uuid, gpu.model, gpu.capability, gpu.memory
                ));
            }
            std::fs::write(dir.join(format!("gpus-{letter}.toml")), gpus)?;
            let toml = format!(
                r#"node_name = "{node}"
manager_url = "https://{host}:{port}"
ca_dir = "{ca}"
token_file = "{token}"

[gpu]
backend = "simulated"
file = "{gpus}"

[images]
store = "{images}"

[streams]
listen = "{address}:{STREAM_PORT}"
tls_cert = "{cert}"
tls_key = "{key}"
gateway_token_file = "{gateway_token}"

[network]
iptables = "{iptables}"
"#,
                node = node.name,
                port = MANAGER_PORT_PLACEHOLDER,
                ca = self.site.pki.ca_dir.display(),
                token = dir.join(format!("node-token-{letter}")).display(),
                gpus = dir.join(format!("gpus-{letter}.toml")).display(),
                images = self.site.images_dir().display(),
                address = node.address,
                cert = dir.join(format!("agent-{letter}.crt")).display(),
                key = dir.join(format!("agent-{letter}.key")).display(),
                gateway_token = dir.join("gateway-token").display(),
                iptables = wrappers.join("iptables").display(),
            );
            std::fs::write(dir.join(format!("agent-{letter}.toml")), toml)?;
        }
        std::fs::write(dir.join("agent-tokens"), tokens)?;
        Ok(())
    }

    /// The index of the node named `name`.
    pub fn index_of(&self, name: &str) -> usize {
        self.nodes
            .iter()
            .position(|n| n.name == name)
            .unwrap_or_else(|| panic!("no node {name}"))
    }

    /// Starts (or restarts) node `i`'s agent inside its namespace.
    pub fn start_agent(&mut self, i: usize) {
        let manager = self.site.manager_addr.clone().expect("the manager runs");
        let port = manager.rsplit(':').next().expect("a port").to_owned();
        let letter = self.nodes[i].letter;
        let config = self.site.dir.path().join(format!("agent-{letter}.toml"));
        let text = std::fs::read_to_string(&config).expect("read the agent's config");
        std::fs::write(&config, text.replace(MANAGER_PORT_PLACEHOLDER, &port))
            .expect("write the agent's config");
        assert!(
            self.nodes[i].agent.is_none(),
            "the agent of {} runs already",
            self.nodes[i].name
        );
        // nsenter execs the agent: the child is the agent itself (signals reach it).
        let child = Command::new("nsenter")
            .arg(format!("--net=/run/netns/{}", self.nodes[i].netns))
            .arg("--")
            .arg(binary("ongrid-agent"))
            .arg("--config")
            .arg(&config)
            .env("TMPDIR", self.site.agent_tmp())
            .env(
                "ONGRID_LOG",
                crate::log_filter_of("info,ongrid_agent=debug"),
            )
            .stdout(Stdio::null())
            .stderr(self.site.log_file(&format!("agent-{letter}")))
            .spawn()
            .expect("spawn ongrid-agent in its namespace (nsenter, util-linux)");
        self.nodes[i].agent = Some(Process::new(
            child,
            &format!("ongrid-agent of {}", self.nodes[i].name),
        ));
    }

    /// Kills node `i`'s agent with SIGKILL (a crash); its containers keep running.
    pub fn kill_agent(&mut self, i: usize) {
        self.nodes[i]
            .agent
            .take()
            .expect("the agent runs")
            .kill_hard();
    }

    /// Stops node `i`'s agent with SIGTERM, as `systemctl restart` does, and waits for it.
    pub fn stop_agent(&mut self, i: usize) {
        terminate(self.nodes[i].agent.take().expect("the agent runs"));
    }

    /// Cuts the gateway off node `i`: its namespace drops every packet to the stream endpoint
    /// (the manager still reaches it). Undone by [`Cluster::heal`] or when the namespace goes.
    pub fn partition(&self, i: usize) {
        self.stream_rule(i, "-I");
    }

    pub fn heal(&self, i: usize) {
        self.stream_rule(i, "-D");
    }

    fn stream_rule(&self, i: usize, action: &str) {
        let port = STREAM_PORT.to_string();
        let args = [action, "INPUT", "-p", "tcp", "--dport", &port, "-j", "DROP"];
        let out = netns_command(&self.nodes[i].netns, "iptables")
            .arg("-w")
            .args(args)
            .output()
            .expect("run iptables in the node's namespace");
        assert!(
            out.status.success(),
            "iptables {} in {}: {}",
            args.join(" "),
            self.nodes[i].netns,
            String::from_utf8_lossy(&out.stderr)
        );
    }

    /// Waits until the manager lists every node online with its GPUs.
    pub fn wait_for_nodes(&self) {
        let names: Vec<String> = self.nodes.iter().map(|n| n.name.clone()).collect();
        self.wait_until(
            "every node to register its GPUs",
            Duration::from_secs(30),
            || {
                let listed: Value = self.site.devctl_json(&self.site.admin, &["gpus"]).ok()?;
                let online = listed.as_array()?;
                names
                    .iter()
                    .all(|name| {
                        online
                            .iter()
                            .any(|n| n["name"] == name.as_str() && n["online"] == true)
                    })
                    .then_some(())
            },
        );
    }

    /// Polls `check` every 250 ms until it returns `Some`, or panics with every log's tail.
    pub fn wait_until<T>(
        &self,
        what: &str,
        timeout: Duration,
        mut check: impl FnMut() -> Option<T>,
    ) -> T {
        let start = Instant::now();
        loop {
            if let Some(value) = check() {
                return value;
            }
            assert!(
                start.elapsed() <= timeout,
                "timed out after {timeout:?} waiting for {what}\n{}",
                self.logs()
            );
            std::thread::sleep(Duration::from_millis(250));
        }
    }

    /// The tail of the manager's, the gateway's and every agent's log.
    pub fn logs(&self) -> String {
        self.site.logs()
    }
}

impl Drop for Cluster {
    fn drop(&mut self) {
        for node in &mut self.nodes {
            drop(node.agent.take());
        }
        for node in &self.nodes {
            remove_docker_objects(None, &node.name, &self.site.suffix);
            remove_firewall_chains(&node.name);
        }
    }
}

/// Stands for the manager's port in the agents' configs until the manager has announced it.
const MANAGER_PORT_PLACEHOLDER: &str = "@MANAGER_PORT@";

/// A server certificate `<stem>.crt`/`.key` for these IP addresses (and localhost).
fn issue_server(site: &Site, stem: &str, addresses: &[Ipv4Addr]) -> anyhow::Result<()> {
    let mut params = CertificateParams::new(vec!["localhost".to_owned()])?;
    for address in addresses {
        params
            .subject_alt_names
            .push(SanType::IpAddress((*address).into()));
    }
    params.distinguished_name = grid_dn("ongrid-test", stem);
    params.key_usages = vec![KeyUsagePurpose::DigitalSignature];
    params.extended_key_usages = vec![ExtendedKeyUsagePurpose::ServerAuth];
    site.pki.issue(stem, params)?;
    Ok(())
}

/// `nsenter --net=/run/netns/<netns> <program>`: a program in a node's network namespace (and
/// nothing else of it, unlike `ip netns exec`, which also mounts its own /sys).
fn netns_command(netns: &str, program: &str) -> Command {
    let mut cmd = Command::new("nsenter");
    cmd.arg(format!("--net=/run/netns/{netns}"))
        .arg("--")
        .arg(program);
    cmd
}

/// The bridge, the namespaces and the veth pairs of a cluster; removed when dropped.
struct HostNetwork {
    /// `e2n<suffix>`: the host's end, holding `10.77.<subnet>.1/24`.
    bridge: String,
    subnet: u8,
    netns: Vec<String>,
}

impl HostNetwork {
    /// A bridge and `count` namespaces, each joined to it by a veth pair (`eth0` inside).
    fn create(suffix: &str, count: usize) -> anyhow::Result<Self> {
        let subnet = free_subnet(suffix)?;
        let mut network = Self {
            bridge: format!("e2n{suffix}"),
            subnet,
            netns: Vec::new(),
        };
        let host = format!("{}/24", network.host_address());
        ip(&["link", "add", &network.bridge, "type", "bridge"])?;
        ip(&["addr", "add", &host, "dev", &network.bridge])?;
        ip(&["link", "set", &network.bridge, "up"])?;
        for i in 0..count {
            let letter = char::from(b'a' + u8::try_from(i)?);
            let netns = format!("ongrid-{suffix}-{letter}");
            ip(&["netns", "add", &netns])?;
            network.netns.push(netns.clone());
            let veth = format!("{}{letter}", network.bridge);
            ip(&[
                "link", "add", &veth, "type", "veth", "peer", "name", "eth0", "netns", &netns,
            ])?;
            ip(&["link", "set", &veth, "master", &network.bridge, "up"])?;
            let address = format!("{}/24", network.node_address(i));
            ip(&["-n", &netns, "addr", "add", &address, "dev", "eth0"])?;
            ip(&["-n", &netns, "link", "set", "eth0", "up"])?;
            ip(&["-n", &netns, "link", "set", "lo", "up"])?;
        }
        Ok(network)
    }

    /// The host's address on the bridge, where the manager listens.
    fn host_address(&self) -> Ipv4Addr {
        Ipv4Addr::new(10, 77, self.subnet, 1)
    }

    /// Node `i`'s address: `10.77.<subnet>.<11 + i>`.
    fn node_address(&self, i: usize) -> Ipv4Addr {
        Ipv4Addr::new(
            10,
            77,
            self.subnet,
            11 + u8::try_from(i).expect("a few nodes"),
        )
    }
}

impl Drop for HostNetwork {
    fn drop(&mut self) {
        // Deleting a namespace deletes its end of the veth pair, and so the pair.
        for netns in &self.netns {
            let _ = ip(&["netns", "del", netns]);
        }
        let _ = ip(&["link", "del", &self.bridge]);
    }
}

/// A /24 of 10.77.0.0/16 that no route of the host uses yet, starting from the suffix's.
fn free_subnet(suffix: &str) -> anyhow::Result<u8> {
    let start = u8::from_str_radix(&suffix[..2], 16)?;
    for offset in 0..=255u8 {
        let subnet = start.wrapping_add(offset);
        let prefix = format!("10.77.{subnet}.0/24");
        let out = Command::new("ip")
            .args(["-4", "route", "show", "match", &prefix])
            .output()?;
        let used = String::from_utf8_lossy(&out.stdout)
            .lines()
            .any(|l| l.starts_with("10.77."));
        if !used {
            return Ok(subnet);
        }
    }
    anyhow::bail!("every /24 of 10.77.0.0/16 is routed already: remove stale e2n* bridges")
}

/// Runs `ip ARGS` (iproute2) as root; fails with its stderr.
fn ip(args: &[&str]) -> anyhow::Result<()> {
    let out = Command::new("ip")
        .args(args)
        .output()
        .map_err(|e| anyhow::anyhow!("run ip {} (iproute2): {e}", args.join(" ")))?;
    if !out.status.success() {
        anyhow::bail!(
            "ip {} failed (the multi-node tests need root): {}",
            args.join(" "),
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    Ok(())
}
