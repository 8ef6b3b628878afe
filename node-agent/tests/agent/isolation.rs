//! Network isolation against the real Docker daemon and the host's iptables: dev containers of
//! different users cannot connect to each other, nor to services of the node, nor to link-local
//! or denied addresses, while allowed destinations stay reachable.
//!
//! Every destination is a listener the test places itself: in another container, on the host,
//! or in a network namespace the test creates (`ip netns add`, a veth pair, addresses of the
//! link-local and benchmarking ranges). No traffic leaves this machine. Each probe that must
//! fail has a positive control (the host reaches the same listener), so a blocked probe means
//! the rules, not a missing listener.

use std::net::{Ipv4Addr, SocketAddr, TcpListener as StdListener};
use std::process::Command;
use std::time::Duration;

use ongrid_agent::network::{FirewallState, NetworkPolicy, INTERFACE_PREFIX};
use ongrid_agent::reconcile::Reconciler;
use ongrid_core::api::{ContainerState, DesiredSession};
use tokio::io::AsyncWriteExt;

use crate::netns::TestNetns;
use crate::{docker, exists, inspect, unique, TestNode};

const GREETING: &str = "hello";

async fn start(reconciler: &mut Reconciler, sessions: &[DesiredSession]) {
    reconciler.converge(sessions).await.expect("Docker answers");
    let report = reconciler.observe().await.expect("Docker answers");
    assert_eq!(report.len(), sessions.len(), "{report:#?}");
    for observed in &report {
        assert_eq!(observed.state, ContainerState::Running, "{observed:?}");
    }
}

/// The container's only network: its name and the container's and gateway's addresses.
fn network_of(session: &DesiredSession) -> (String, Ipv4Addr, Ipv4Addr) {
    let container = inspect("container", &session.session_id.container_name());
    let networks = container["NetworkSettings"]["Networks"]
        .as_object()
        .expect("networks")
        .clone();
    assert_eq!(networks.len(), 1, "only its own network: {networks:?}");
    let (name, settings) = networks.into_iter().next().expect("one network");
    let address = |key: &str| {
        settings[key]
            .as_str()
            .and_then(|a| a.parse().ok())
            .unwrap_or_else(|| panic!("{key} of {name}: {settings}"))
    };
    (name.clone(), address("IPAddress"), address("Gateway"))
}

/// Connects from inside the container to `ip:port` and returns what the peer sent, or `None`
/// when no connection was made within 3 s. Async, so that the test's own listeners (tasks of
/// this runtime) answer meanwhile.
async fn probe_from(session: &DesiredSession, ip: Ipv4Addr, port: u16) -> Option<String> {
    let script = format!(
        "exec 3<>/dev/tcp/{ip}/{port} && head -c {} <&3",
        GREETING.len()
    );
    let output = tokio::process::Command::new("docker")
        .args([
            "exec",
            &session.session_id.container_name(),
            "timeout",
            "3",
            "bash",
            "-c",
            &script,
        ])
        .output()
        .await
        .expect("the docker CLI");
    output
        .status
        .success()
        .then(|| String::from_utf8_lossy(&output.stdout).into_owned())
}

/// Connects from the host (the positive control).
async fn probe_from_host(ip: Ipv4Addr, port: u16) -> Option<String> {
    use tokio::io::AsyncReadExt;
    let connect = tokio::net::TcpStream::connect(SocketAddr::from((ip, port)));
    let mut stream = tokio::time::timeout(Duration::from_secs(3), connect)
        .await
        .ok()?
        .ok()?;
    let mut buffer = vec![0; GREETING.len()];
    tokio::time::timeout(Duration::from_secs(3), stream.read_exact(&mut buffer))
        .await
        .ok()?
        .ok()?;
    Some(String::from_utf8_lossy(&buffer).into_owned())
}

/// Serves the greeting to every connection on `listener` until the test ends.
fn serve_greeting(listener: StdListener) -> u16 {
    listener.set_nonblocking(true).expect("non-blocking");
    let port = listener.local_addr().expect("bound").port();
    let listener = tokio::net::TcpListener::from_std(listener).expect("tokio listener");
    tokio::spawn(async move {
        while let Ok((mut stream, _)) = listener.accept().await {
            let _ = stream.write_all(GREETING.as_bytes()).await;
        }
    });
    port
}

/// A greeting listener inside the container, as its user, on `port`.
fn listen_in(session: &DesiredSession, port: u16) {
    let program = format!(
        "import socket\ns = socket.socket()\ns.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)\n\
         s.bind(('0.0.0.0', {port}))\ns.listen(8)\nwhile True:\n    c, _ = s.accept()\n    \
         c.sendall(b'{GREETING}')\n    c.close()\n"
    );
    docker(&[
        "exec",
        "-d",
        &session.session_id.container_name(),
        "python3",
        "-c",
        &program,
    ]);
}

#[tokio::test]
async fn containers_of_different_users_cannot_connect_to_each_other() {
    let node = TestNode::new().await;
    let a = node.session();
    let b = node.session();
    assert_ne!(a.user.name, b.user.name);
    let mut reconciler = node.reconciler();
    start(&mut reconciler, &[a.clone(), b.clone()]).await;

    let (net_a, ip_a, _) = network_of(&a);
    let (net_b, ip_b, _) = network_of(&b);
    assert_ne!(net_a, net_b, "each session has its own network");
    for (session, name) in [(&a, &net_a), (&b, &net_b)] {
        let network = inspect("network", name);
        assert_eq!(network["Labels"]["ongrid.node"], node.node.as_str());
        assert_eq!(
            network["Labels"]["ongrid.session"],
            session.session_id.to_string()
        );
        let options = &network["Options"];
        assert_eq!(options["com.docker.network.bridge.enable_icc"], "false");
        let bridge = options["com.docker.network.bridge.name"]
            .as_str()
            .expect("bridge name");
        assert!(bridge.starts_with(INTERFACE_PREFIX), "{bridge}");
        assert_eq!(
            crate::docker(&[
                "exec",
                &session.session_id.container_name(),
                "cat",
                "/proc/sys/net/ipv6/conf/all/disable_ipv6"
            ]),
            "1",
            "no IPv6 in dev containers"
        );
    }

    let port = 8000;
    listen_in(&a, port);
    listen_in(&b, port);
    // Control: both listen, and the host reaches them.
    for ip in [ip_a, ip_b] {
        let mut reached = None;
        for _ in 0..50 {
            reached = probe_from_host(ip, port).await;
            if reached.is_some() {
                break;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        assert_eq!(reached.as_deref(), Some(GREETING), "the host reaches {ip}");
    }
    assert_eq!(probe_from(&a, ip_b, port).await, None, "A reached B");
    assert_eq!(probe_from(&b, ip_a, port).await, None, "B reached A");
    // Each reaches its own listener: the probe itself works.
    assert_eq!(probe_from(&a, ip_a, port).await.as_deref(), Some(GREETING));

    // Ended: containers and networks go; a restarted agent (a new reconciler) cleans up too.
    let mut restarted = node.reconciler();
    restarted.converge(&[]).await.expect("Docker answers");
    assert!(!exists("network", &net_a), "{net_a} left behind");
    assert!(!exists("network", &net_b), "{net_b} left behind");
}

/// The host's IPv4 addresses other than loopback.
fn host_addresses() -> Vec<Ipv4Addr> {
    let output = Command::new("ip")
        .args(["-4", "-o", "addr", "show"])
        .output()
        .expect("the ip command");
    String::from_utf8_lossy(&output.stdout)
        .lines()
        .filter_map(|line| {
            let cidr = line
                .split_whitespace()
                .skip_while(|w| *w != "inet")
                .nth(1)?;
            cidr.split('/').next()?.parse::<Ipv4Addr>().ok()
        })
        .filter(|ip| !ip.is_loopback())
        .collect()
}

#[tokio::test]
async fn a_container_cannot_reach_services_of_the_node() {
    let node = TestNode::new().await;
    let session = node.session();
    let mut reconciler = node.reconciler();
    start(&mut reconciler, std::slice::from_ref(&session)).await;
    let (_, _, gateway) = network_of(&session);

    // Like the agent's stream endpoint with `listen = "0.0.0.0:..."`.
    let port = serve_greeting(StdListener::bind("0.0.0.0:0").expect("bind"));
    let mut targets = vec![gateway];
    targets.extend(
        host_addresses()
            .into_iter()
            .filter(|ip| *ip != gateway)
            .take(2),
    );
    for ip in targets {
        assert_eq!(
            probe_from_host(ip, port).await.as_deref(),
            Some(GREETING),
            "control: the host reaches its own listener on {ip}"
        );
        assert_eq!(
            probe_from(&session, ip, port).await,
            None,
            "the container reached the node's port on {ip}"
        );
    }

    // The rules are checked every pass and put back when someone removes them.
    let rules = node.firewall.rules().clone();
    let status = Command::new("/usr/sbin/iptables")
        .args(["-w", "-D", "INPUT"])
        .args(rules.input_jump().split_whitespace())
        .status()
        .expect("iptables");
    assert!(status.success());
    reconciler
        .converge(std::slice::from_ref(&session))
        .await
        .expect("Docker answers");
    assert_eq!(
        probe_from(&session, gateway, port).await,
        None,
        "the input rule was not restored"
    );
}

#[tokio::test]
async fn link_local_and_denied_destinations_are_closed_and_allowed_ones_open() {
    let third = u8::try_from(u32::from_str_radix(&unique()[..2], 16).unwrap_or(7) % 250 + 2)
        .expect("below 256");
    let link_local = [169, 254, third];
    let allowed = [198, 18, third];
    let denied = [198, 19, third];
    let netns = TestNetns::new(&[link_local, allowed, denied]);
    let port = serve_greeting(netns.listener());

    // Everything open but the benchmarking range, and one /24 of it open again.
    let policy = NetworkPolicy::parse(
        NetworkPolicy::DEFAULT_SUBNET_POOL,
        &["0.0.0.0/0".to_owned(), format!("198.18.{third}.0/24")],
        &["198.18.0.0/15".to_owned()],
    )
    .expect("valid policy");
    let node = TestNode::with_policy(policy).await;
    let session = node.session();
    let mut reconciler = node.reconciler();
    start(&mut reconciler, std::slice::from_ref(&session)).await;

    let address = |[a, b, c]: [u8; 3]| Ipv4Addr::new(a, b, c, 2);
    for network in [link_local, allowed, denied] {
        assert_eq!(
            probe_from_host(address(network), port).await.as_deref(),
            Some(GREETING),
            "control: the host reaches {}",
            address(network)
        );
    }
    // Each time Docker creates a network it takes `FORWARD`'s jump to `DOCKER-USER` out and puts
    // it back; in between, its own rules accept what leaves a bridge. The same moment for this
    // node's bridges only, held open in the second pass: the rules still close what they close.
    for docker_window in [false, true] {
        let _window = docker_window.then(|| DockerWindow::open(&node.firewall.rules().interfaces));
        let when = if docker_window {
            " while Docker's jump is out"
        } else {
            ""
        };
        assert_eq!(
            probe_from(&session, address(allowed), port)
                .await
                .as_deref(),
            Some(GREETING),
            "an allowed destination is reachable{when}"
        );
        assert_eq!(
            probe_from(&session, address(link_local), port).await,
            None,
            "a link-local address was reached{when}"
        );
        assert_eq!(
            probe_from(&session, address(denied), port).await,
            None,
            "a denied address was reached{when}"
        );
    }
}

/// An `ACCEPT` first in `filter`'s `FORWARD` for traffic from `interfaces` (the test node's
/// bridges), as Docker's rules act while its jump to `DOCKER-USER` is out; removed on drop.
struct DockerWindow {
    rule: Vec<String>,
}

impl DockerWindow {
    fn open(interfaces: &str) -> Self {
        let rule = ["-i", interfaces, "-j", "ACCEPT"]
            .map(str::to_owned)
            .to_vec();
        let status = Command::new("/usr/sbin/iptables")
            .args(["-w", "-I", "FORWARD", "1"])
            .args(&rule)
            .status()
            .expect("iptables");
        assert!(status.success());
        Self { rule }
    }
}

impl Drop for DockerWindow {
    fn drop(&mut self) {
        let _ = Command::new("/usr/sbin/iptables")
            .args(["-w", "-D", "FORWARD"])
            .args(&self.rule)
            .status();
    }
}

#[tokio::test]
async fn the_forward_chain_earlier_agents_kept_behind_docker_user_is_replaced() {
    let node = TestNode::new().await;
    let rules = node.firewall.rules().clone();
    let iptables = |args: &[&str]| {
        Command::new("/usr/sbin/iptables")
            .arg("-w")
            .args(args)
            .stderr(std::process::Stdio::null())
            .status()
            .expect("iptables")
            .success()
    };
    // What an agent before the move left: the forward chain in filter, jumped to from
    // DOCKER-USER, with the policy of its day (here: everything open).
    let (chain, interfaces) = (rules.forward_chain.as_str(), rules.interfaces.as_str());
    assert!(iptables(&["-N", chain]) && iptables(&["-A", chain, "-j", "RETURN"]));
    let jump = ["-i", interfaces, "-j", chain];
    assert!(iptables(&[&["-I", "DOCKER-USER", "1"][..], &jump].concat()));

    let state = node.firewall.ensure_blocking().expect("rules installed");
    assert_eq!(state, FirewallState::Installed);
    assert!(
        !iptables(&[&["-C", "DOCKER-USER"][..], &jump].concat()),
        "the jump from DOCKER-USER is gone"
    );
    assert!(!iptables(&["-S", chain]), "the chain in filter is gone");
    assert!(
        iptables(&["-t", "mangle", "-S", chain]),
        "the chain is in mangle"
    );
    assert!(
        iptables(&[&["-t", "mangle", "-C", "FORWARD"][..], &jump].concat()),
        "mangle's FORWARD jumps to it"
    );
    assert_eq!(
        node.firewall.ensure_blocking().expect("rules checked"),
        FirewallState::InPlace
    );
}
