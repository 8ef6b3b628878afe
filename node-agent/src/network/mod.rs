//! Network isolation of dev containers: what each session's Docker network is, and the host
//! firewall rules that keep its container away from the node and from other sessions.
//!
//! Every session gets its own bridge network ([`NetworkSpec::for_session`]) with inter-container
//! traffic off, a /29 of the configured `subnet_pool`, and a bridge interface named
//! `ong<node tag><session tag>`. All bridges of one agent share the prefix `ong<node tag>`
//! ([`interface_prefix`]), so one wildcard rule per direction covers them, and agents sharing a
//! Docker daemon (the tests, the quickstart) each keep to their own rules and networks.
//!
//! The rules ([`Ruleset`]) are two chains, for traffic coming *from* those bridges:
//!
//! - `ONGRID-IN-<tag>` in the `filter` table, jumped to from `INPUT`: only answers to
//!   connections the host opened get through; a container reaches none of the node's own
//!   addresses (the agent, the manager, the Docker API, anything listening on the bridge gateway
//!   or any other address of the node).
//! - `ONGRID-FWD-<tag>` in the `mangle` table, jumped to from its `FORWARD`: answers pass;
//!   traffic to any ongrid bridge (another session), to a port Docker publishes on the node
//!   (destination NAT), and to link-local addresses (169.254.0.0/16, cloud metadata) is
//!   dropped; then the `[network]` policy decides. It is not in `filter`'s `DOCKER-USER`, where
//!   Docker asks such rules to go, because Docker takes the jump to `DOCKER-USER` out of
//!   `FORWARD` and puts it back each time it creates a network: in between, Docker's own rules
//!   accept whatever leaves a bridge, and a connection opened then stays open (answers pass).
//!   Docker's bridge driver leaves the host's `mangle` alone, and its `FORWARD` runs before
//!   `filter`'s (so rules an administrator adds to `DOCKER-USER` cannot let through what these
//!   drop).
//!
//! [`NetworkPolicy`]: the most specific `allow` or `deny` entry containing the destination
//! decides; a destination in no entry is dropped. IPv6 is switched off inside dev containers, so
//! the rules are IPv4 only.
//!
//! [`HostFirewall`] is the boundary: [`iptables::Iptables`] installs and checks the rules with
//! the node's iptables; tests of the reconciler use a fake.

pub mod iptables;

use std::collections::BTreeMap;
use std::fmt;
use std::net::Ipv4Addr;
use std::str::FromStr;

use futures::future::BoxFuture;
use ongrid_core::{NodeName, SessionId};

use crate::labels::{LABEL_MANAGED, LABEL_NODE, LABEL_SESSION};

/// Prefix of every ongrid bridge interface on any node: `ong<node tag><session tag>`.
pub const INTERFACE_PREFIX: &str = "ong";

/// Link-local addresses (cloud metadata services among them): never reachable, whatever the
/// policy says.
pub const LINK_LOCAL: Ipv4Net = Ipv4Net {
    addr: Ipv4Addr::new(169, 254, 0, 0),
    prefix: 16,
};

/// The prefix length of each session's subnet: network, gateway, the container, broadcast, and
/// room to spare.
pub const SESSION_SUBNET_PREFIX: u8 = 29;

/// An IPv4 network in CIDR notation, host bits zero.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Ipv4Net {
    addr: Ipv4Addr,
    prefix: u8,
}

/// Why a CIDR was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum CidrError {
    #[error("{0:?} is not an IPv4 network like 10.1.0.0/16")]
    Malformed(String),
    #[error("{0:?} is IPv6: dev containers have no IPv6, list IPv4 networks only")]
    Ipv6(String),
    #[error("{text:?} has host bits set: write {network}")]
    HostBits { text: String, network: Ipv4Net },
}

impl Ipv4Net {
    /// The network `addr/prefix`; `None` when host bits are set or the prefix exceeds 32.
    pub fn new(addr: Ipv4Addr, prefix: u8) -> Option<Self> {
        (prefix <= 32 && u32::from(addr) & !mask(prefix) == 0).then_some(Self { addr, prefix })
    }

    pub fn addr(&self) -> Ipv4Addr {
        self.addr
    }

    pub fn prefix(&self) -> u8 {
        self.prefix
    }

    /// Whether the two networks share an address.
    pub fn overlaps(&self, other: &Ipv4Net) -> bool {
        let prefix = self.prefix.min(other.prefix);
        u32::from(self.addr) & mask(prefix) == u32::from(other.addr) & mask(prefix)
    }

    /// The `n`th address of the network (`0` is the network's own address).
    pub fn host(&self, n: u32) -> Ipv4Addr {
        Ipv4Addr::from(u32::from(self.addr).wrapping_add(n))
    }
}

fn mask(prefix: u8) -> u32 {
    match prefix {
        0 => 0,
        p => u32::MAX << (32 - u32::from(p.min(32))),
    }
}

impl FromStr for Ipv4Net {
    type Err = CidrError;

    fn from_str(text: &str) -> Result<Self, CidrError> {
        let malformed = || CidrError::Malformed(text.to_owned());
        let trimmed = text.trim();
        if trimmed.contains(':') {
            return Err(CidrError::Ipv6(text.to_owned()));
        }
        let (addr, prefix) = trimmed.split_once('/').ok_or_else(malformed)?;
        let addr: Ipv4Addr = addr.parse().map_err(|_| malformed())?;
        let prefix: u8 = prefix
            .parse()
            .ok()
            .filter(|p| *p <= 32)
            .ok_or_else(malformed)?;
        Self::new(addr, prefix).ok_or_else(|| CidrError::HostBits {
            text: text.to_owned(),
            network: Self {
                addr: Ipv4Addr::from(u32::from(addr) & mask(prefix)),
                prefix,
            },
        })
    }
}

impl fmt::Display for Ipv4Net {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.addr, self.prefix)
    }
}

/// Where dev containers may connect to, and where their networks' addresses come from: the
/// validated `[network]` table of the agent's config.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NetworkPolicy {
    /// Each session's network takes a /29 of it.
    pub subnet_pool: Ipv4Net,
    /// Destinations dev containers may reach ...
    pub allow: Vec<Ipv4Net>,
    /// ... and those they may not; the most specific entry containing a destination decides.
    pub deny: Vec<Ipv4Net>,
}

/// Why the `[network]` table was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PolicyError {
    #[error("[network] {key}: {source}")]
    Cidr {
        key: &'static str,
        #[source]
        source: CidrError,
    },
    #[error("[network] {network} is in both allow and deny: keep it in one")]
    Both { network: Ipv4Net },
    #[error(
        "[network] allow {network} would open link-local addresses (169.254.0.0/16, cloud \
         metadata), which stay closed: allow a network outside them"
    )]
    LinkLocal { network: Ipv4Net },
    #[error("[network] subnet_pool {0} is too small: give a /{SESSION_SUBNET_PREFIX} or larger, like 10.213.0.0/16")]
    PoolTooSmall(Ipv4Net),
}

impl NetworkPolicy {
    pub const DEFAULT_SUBNET_POOL: &'static str = "10.213.0.0/16";
    pub const DEFAULT_ALLOW: [&'static str; 1] = ["0.0.0.0/0"];
    /// The private, shared and multicast ranges: the site's own networks are closed unless
    /// allowed by a more specific entry (a package mirror, the storage).
    pub const DEFAULT_DENY: [&'static str; 6] = [
        "10.0.0.0/8",
        "100.64.0.0/10",
        "127.0.0.0/8",
        "172.16.0.0/12",
        "192.168.0.0/16",
        "224.0.0.0/3",
    ];

    /// Validates the table's values (CIDR text).
    pub fn parse(
        subnet_pool: &str,
        allow: &[String],
        deny: &[String],
    ) -> Result<Self, PolicyError> {
        let cidr = |key: &'static str, text: &str| {
            text.parse::<Ipv4Net>()
                .map_err(|source| PolicyError::Cidr { key, source })
        };
        let subnet_pool = cidr("subnet_pool", subnet_pool)?;
        if subnet_pool.prefix > SESSION_SUBNET_PREFIX {
            return Err(PolicyError::PoolTooSmall(subnet_pool));
        }
        let allow = allow
            .iter()
            .map(|t| cidr("allow", t))
            .collect::<Result<Vec<_>, _>>()?;
        let deny = deny
            .iter()
            .map(|t| cidr("deny", t))
            .collect::<Result<Vec<_>, _>>()?;
        if let Some(network) = allow.iter().find(|a| deny.contains(a)) {
            return Err(PolicyError::Both { network: *network });
        }
        // An allow entry more specific than 169.254.0.0/16 would be tried before the fixed rule
        // in people's minds, though not in the chain: refuse it rather than mislead.
        if let Some(network) = allow
            .iter()
            .find(|a| a.prefix > LINK_LOCAL.prefix && a.overlaps(&LINK_LOCAL))
        {
            return Err(PolicyError::LinkLocal { network: *network });
        }
        Ok(Self {
            subnet_pool,
            allow,
            deny,
        })
    }

    /// The defaults, as documented in the example config.
    pub fn default_policy() -> Self {
        let owned = |list: &[&str]| list.iter().map(|s| (*s).to_owned()).collect::<Vec<_>>();
        #[allow(clippy::expect_used)] // constants, checked by a test
        Self::parse(
            Self::DEFAULT_SUBNET_POOL,
            &owned(&Self::DEFAULT_ALLOW),
            &owned(&Self::DEFAULT_DENY),
        )
        .expect("the default policy is valid")
    }

    /// Whether a dev container may open a connection to `destination` (the rule the firewall
    /// carries out, for tests and documentation).
    pub fn allows(&self, destination: Ipv4Addr) -> bool {
        let host = Ipv4Net {
            addr: destination,
            prefix: 32,
        };
        if LINK_LOCAL.overlaps(&host) {
            return false;
        }
        self.decisions()
            .into_iter()
            .find(|(net, _)| net.overlaps(&host))
            .is_some_and(|(_, allowed)| allowed)
    }

    /// Every entry with its verdict, most specific first (allow before deny at equal length
    /// cannot happen: `parse` refuses the same network in both).
    fn decisions(&self) -> Vec<(Ipv4Net, bool)> {
        let mut all: Vec<(Ipv4Net, bool)> = self
            .allow
            .iter()
            .map(|n| (*n, true))
            .chain(self.deny.iter().map(|n| (*n, false)))
            .collect();
        all.sort_by(|a, b| b.0.prefix.cmp(&a.0.prefix).then(a.0.cmp(&b.0)));
        all.dedup();
        all
    }
}

/// A free /29 of `pool` for `session`, overlapping none of `used`: the search starts at a
/// place derived from the session, so concurrent creations rarely collide.
pub fn pick_subnet(pool: Ipv4Net, session: SessionId, used: &[Ipv4Net]) -> Option<Ipv4Net> {
    let count = 1u64 << (SESSION_SUBNET_PREFIX.saturating_sub(pool.prefix));
    let start = u64::from(fnv1a(session.0.as_bytes())) % count;
    let step = 1u32 << (32 - SESSION_SUBNET_PREFIX);
    (0..count)
        .map(|i| (start + i) % count)
        .filter_map(|index| {
            let offset = u32::try_from(index).ok()?.checked_mul(step)?;
            Ipv4Net::new(pool.host(offset), SESSION_SUBNET_PREFIX)
        })
        .find(|candidate| !used.iter().any(|u| u.overlaps(candidate)))
}

/// FNV-1a, 32 bits: a stable short hash for names (std's hasher may change between releases).
fn fnv1a(bytes: &[u8]) -> u32 {
    bytes.iter().fold(0x811c_9dc5, |hash: u32, byte| {
        (hash ^ u32::from(*byte)).wrapping_mul(0x0100_0193)
    })
}

/// Four hex digits naming the agent's node in interface and chain names.
pub fn node_tag(node: &NodeName) -> String {
    format!("{:04x}", fnv1a(node.as_str().as_bytes()) & 0xffff)
}

/// `ong<node tag>`: the first characters of every bridge interface of this node's sessions.
pub fn interface_prefix(node: &NodeName) -> String {
    format!("{INTERFACE_PREFIX}{}", node_tag(node))
}

/// One session's Docker network as the agent creates it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NetworkSpec {
    pub session_id: SessionId,
    /// `ongrid-net-<session id>`.
    pub name: String,
    /// The Linux bridge: `ong<node tag><8 hex digits of the session>`, 15 characters, the most
    /// Linux allows.
    pub bridge: String,
    pub labels: BTreeMap<String, String>,
    /// Where its /29 comes from.
    pub subnet_pool: Ipv4Net,
}

impl NetworkSpec {
    pub fn for_session(node: &NodeName, session_id: SessionId, subnet_pool: Ipv4Net) -> Self {
        let simple = session_id.0.simple().to_string();
        Self {
            session_id,
            name: network_name(session_id),
            bridge: format!("{}{}", interface_prefix(node), &simple[..8]),
            labels: BTreeMap::from([
                (LABEL_MANAGED.to_owned(), "true".to_owned()),
                (LABEL_NODE.to_owned(), node.to_string()),
                (LABEL_SESSION.to_owned(), session_id.to_string()),
            ]),
            subnet_pool,
        }
    }

    /// Docker's bridge driver options: the interface name, and no traffic between containers
    /// of the network (there is only one, but a second must not change that).
    pub fn driver_options(&self) -> BTreeMap<String, String> {
        BTreeMap::from([
            (
                "com.docker.network.bridge.name".to_owned(),
                self.bridge.clone(),
            ),
            (
                "com.docker.network.bridge.enable_icc".to_owned(),
                "false".to_owned(),
            ),
            (
                "com.docker.network.bridge.enable_ip_masquerade".to_owned(),
                "true".to_owned(),
            ),
        ])
    }
}

/// `ongrid-net-<session id>`: the name of a session's network.
pub fn network_name(session_id: SessionId) -> String {
    format!("ongrid-net-{}", session_id.0.simple())
}

/// The firewall rules of one node: two chains and the jumps into them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Ruleset {
    /// `ong<tag>+`: the bridges the jumps match.
    pub interfaces: String,
    pub input_chain: String,
    pub forward_chain: String,
    /// Rule specifications after `-A <input_chain>`, as `iptables -S` prints them.
    pub input_rules: Vec<String>,
    /// Rule specifications after `-A <forward_chain>`, as `iptables -S` prints them.
    pub forward_rules: Vec<String>,
}

/// The built-in chain the input jump goes into (in [`FILTER`]).
pub const INPUT: &str = "INPUT";
/// The built-in chain the forward jump goes into (in [`MANGLE`]).
pub const FORWARD: &str = "FORWARD";
/// The table of the input chain.
pub const FILTER: &str = "filter";
/// The table of the forward chain: its `FORWARD` runs before `filter`'s, and Docker leaves it
/// alone.
pub const MANGLE: &str = "mangle";
/// Docker's chain for the administrator's forwarding rules: its presence shows that dockerd
/// manages iptables (and so masquerades the sessions' traffic). Agents before the forward
/// chain moved to [`MANGLE`] jumped to it from here.
pub const DOCKER_USER: &str = "DOCKER-USER";

impl Ruleset {
    pub fn new(node: &NodeName, policy: &NetworkPolicy) -> Self {
        let tag = node_tag(node);
        let answers = "-m conntrack --ctstate RELATED,ESTABLISHED -j RETURN".to_owned();
        let mut forward_rules = vec![
            answers.clone(),
            // Another session's bridge, whichever agent made it.
            format!("-o {INTERFACE_PREFIX}+ -j DROP"),
            // A port Docker publishes on one of the node's addresses: a node service.
            "-m conntrack --ctstate DNAT -j DROP".to_owned(),
            format!("-d {LINK_LOCAL} -j DROP"),
        ];
        for (network, allowed) in policy.decisions() {
            let verdict = if allowed { "RETURN" } else { "DROP" };
            // `iptables -S` prints no `-d` for 0.0.0.0/0: write it as it reads back.
            forward_rules.push(match network.prefix {
                0 => format!("-j {verdict}"),
                _ => format!("-d {network} -j {verdict}"),
            });
        }
        forward_rules.push("-j DROP".to_owned());
        Self {
            interfaces: format!("{}+", interface_prefix(node)),
            input_chain: format!("ONGRID-IN-{tag}"),
            forward_chain: format!("ONGRID-FWD-{tag}"),
            input_rules: vec![answers, "-j DROP".to_owned()],
            forward_rules,
        }
    }

    /// The jump from `INPUT`, as `iptables -S` prints it after `-A INPUT`.
    pub fn input_jump(&self) -> String {
        format!("-i {} -j {}", self.interfaces, self.input_chain)
    }

    /// The jump from `mangle`'s `FORWARD` (and, from agents before it moved there, from
    /// `filter`'s `DOCKER-USER`).
    pub fn forward_jump(&self) -> String {
        format!("-i {} -j {}", self.interfaces, self.forward_chain)
    }

    /// `iptables-restore --noflush` input that creates or replaces both chains, each in one
    /// transaction of its table (a chain named on a `:` line is emptied first).
    pub fn restore_script(&self) -> String {
        let mut script = String::new();
        for (table, chain, rules) in [
            (FILTER, &self.input_chain, &self.input_rules),
            (MANGLE, &self.forward_chain, &self.forward_rules),
        ] {
            script.push_str(&format!("*{table}\n:{chain} - [0:0]\n"));
            for rule in rules {
                script.push_str(&format!("-A {chain} {rule}\n"));
            }
            script.push_str("COMMIT\n");
        }
        script
    }
}

/// What [`HostFirewall::ensure`] found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FirewallState {
    /// Every rule was in place.
    InPlace,
    /// Some were missing or different and have been (re)installed.
    Installed,
}

/// Why the firewall rules could not be checked or applied.
#[derive(Debug, thiserror::Error)]
pub enum FirewallError {
    #[error("cannot run {program}: install iptables (Debian: apt-get install iptables)")]
    Spawn {
        program: String,
        #[source]
        source: std::io::Error,
    },
    #[error("{program} {args} failed: {stderr}: the agent must run as root on a node whose Docker manages iptables")]
    Failed {
        program: String,
        args: String,
        stderr: String,
    },
    #[error("Docker's {DOCKER_USER} chain is missing: start dockerd with iptables on (its default) before the agent")]
    NoDockerUser,
    #[error("the rules were installed but do not read back as written: {0}")]
    Mismatch(String),
}

/// The node's packet filter, where the isolation rules live.
pub trait HostFirewall: Send + Sync + 'static {
    /// Checks the rules and (re)installs what is missing or different.
    fn ensure(&self) -> BoxFuture<'_, Result<FirewallState, FirewallError>>;

    /// Takes the rules out again (an agent stopping with no container left to isolate).
    fn remove(&self) -> BoxFuture<'_, Result<(), FirewallError>>;
}

#[cfg(test)]
pub mod fake {
    //! A firewall for unit tests: it works or fails as told, and counts the checks.

    use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};

    use super::*;

    #[derive(Debug, Default)]
    pub struct FakeFirewall {
        pub broken: AtomicBool,
        pub checks: AtomicUsize,
    }

    impl HostFirewall for FakeFirewall {
        fn ensure(&self) -> BoxFuture<'_, Result<FirewallState, FirewallError>> {
            Box::pin(async move {
                self.checks.fetch_add(1, Ordering::SeqCst);
                if self.broken.load(Ordering::SeqCst) {
                    Err(FirewallError::NoDockerUser)
                } else {
                    Ok(FirewallState::InPlace)
                }
            })
        }

        fn remove(&self) -> BoxFuture<'_, Result<(), FirewallError>> {
            Box::pin(async { Ok(()) })
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn net(text: &str) -> Ipv4Net {
        text.parse().unwrap()
    }

    #[test]
    fn cidrs_parse_and_refuse_with_the_fix() {
        assert_eq!(net("10.1.0.0/16").to_string(), "10.1.0.0/16");
        assert_eq!(net("0.0.0.0/0").prefix(), 0);
        let err = "10.1.2.3/16".parse::<Ipv4Net>().unwrap_err();
        assert!(err.to_string().contains("write 10.1.0.0/16"), "{err}");
        assert!(matches!(
            "fe80::/10".parse::<Ipv4Net>(),
            Err(CidrError::Ipv6(_))
        ));
        for bad in ["10.0.0.0", "10.0.0.0/33", "10.0.0/8", "x/8", ""] {
            assert!(bad.parse::<Ipv4Net>().is_err(), "{bad}");
        }
    }

    #[test]
    fn defaults_are_valid_and_close_private_and_link_local_ranges() {
        let policy = NetworkPolicy::default_policy();
        for closed in [
            "10.1.2.3",
            "172.17.0.1",
            "192.168.1.1",
            "169.254.169.254",
            "127.0.0.1",
            "100.100.100.200",
            "224.0.0.251",
        ] {
            assert!(!policy.allows(closed.parse().unwrap()), "{closed}");
        }
        for open in ["1.1.1.1", "198.18.0.1", "151.101.2.132"] {
            assert!(policy.allows(open.parse().unwrap()), "{open}");
        }
    }

    #[test]
    fn the_most_specific_entry_decides() {
        let policy = NetworkPolicy::parse(
            "10.213.0.0/16",
            &["0.0.0.0/0".into(), "10.1.2.0/24".into()],
            &["10.0.0.0/8".into(), "10.1.2.128/25".into()],
        )
        .unwrap();
        assert!(policy.allows("10.1.2.1".parse().unwrap()));
        assert!(!policy.allows("10.1.2.200".parse().unwrap()));
        assert!(!policy.allows("10.9.9.9".parse().unwrap()));
        assert!(policy.allows("8.8.8.8".parse().unwrap()));
        let closed = NetworkPolicy::parse("10.213.0.0/16", &["10.1.2.0/24".into()], &[]).unwrap();
        assert!(
            !closed.allows("8.8.8.8".parse().unwrap()),
            "nothing matches: dropped"
        );
    }

    #[test]
    fn bad_policies_name_the_fix() {
        let both = NetworkPolicy::parse(
            "10.213.0.0/16",
            &["10.0.0.0/8".into()],
            &["10.0.0.0/8".into()],
        );
        assert!(matches!(both, Err(PolicyError::Both { .. })), "{both:?}");
        let metadata = NetworkPolicy::parse("10.213.0.0/16", &["169.254.169.254/32".into()], &[]);
        assert!(
            matches!(metadata, Err(PolicyError::LinkLocal { .. })),
            "{metadata:?}"
        );
        let small = NetworkPolicy::parse("10.213.0.0/30", &[], &[]);
        assert!(
            matches!(small, Err(PolicyError::PoolTooSmall(_))),
            "{small:?}"
        );
        let bad = NetworkPolicy::parse("10.213.0.0/16", &["10.0.0.1/8".into()], &[]).unwrap_err();
        assert!(bad.to_string().contains("[network] allow"), "{bad}");
    }

    #[test]
    fn forward_rules_put_the_fixed_drops_first_and_end_closed() {
        let node = NodeName::parse("node1").unwrap();
        let policy = NetworkPolicy::parse(
            "10.213.0.0/16",
            &["0.0.0.0/0".into(), "10.1.2.0/24".into()],
            &["10.0.0.0/8".into()],
        )
        .unwrap();
        let rules = Ruleset::new(&node, &policy);
        let tag = node_tag(&node);
        assert_eq!(rules.interfaces, format!("ong{tag}+"));
        assert_eq!(rules.forward_chain, format!("ONGRID-FWD-{tag}"));
        assert_eq!(
            rules.forward_rules,
            [
                "-m conntrack --ctstate RELATED,ESTABLISHED -j RETURN",
                "-o ong+ -j DROP",
                "-m conntrack --ctstate DNAT -j DROP",
                "-d 169.254.0.0/16 -j DROP",
                "-d 10.1.2.0/24 -j RETURN",
                "-d 10.0.0.0/8 -j DROP",
                "-j RETURN",
                "-j DROP",
            ]
        );
        assert_eq!(
            rules.input_rules,
            [
                "-m conntrack --ctstate RELATED,ESTABLISHED -j RETURN",
                "-j DROP"
            ]
        );
        let script = rules.restore_script();
        assert_eq!(
            script,
            "*filter\n:ONGRID-IN-{tag} - [0:0]\n\
             -A ONGRID-IN-{tag} -m conntrack --ctstate RELATED,ESTABLISHED -j RETURN\n\
             -A ONGRID-IN-{tag} -j DROP\nCOMMIT\n\
             *mangle\n:ONGRID-FWD-{tag} - [0:0]\n\
             -A ONGRID-FWD-{tag} -m conntrack --ctstate RELATED,ESTABLISHED -j RETURN\n\
             -A ONGRID-FWD-{tag} -o ong+ -j DROP\n\
             -A ONGRID-FWD-{tag} -m conntrack --ctstate DNAT -j DROP\n\
             -A ONGRID-FWD-{tag} -d 169.254.0.0/16 -j DROP\n\
             -A ONGRID-FWD-{tag} -d 10.1.2.0/24 -j RETURN\n\
             -A ONGRID-FWD-{tag} -d 10.0.0.0/8 -j DROP\n\
             -A ONGRID-FWD-{tag} -j RETURN\n\
             -A ONGRID-FWD-{tag} -j DROP\nCOMMIT\n"
                .replace("{tag}", &tag)
        );
    }

    #[test]
    fn bridge_names_fit_linux_and_share_the_node_prefix() {
        let node = NodeName::parse("a-rather-long-node-name-01").unwrap();
        let pool = net("10.213.0.0/16");
        let a = NetworkSpec::for_session(&node, SessionId::new_random(), pool);
        let b = NetworkSpec::for_session(&node, SessionId::new_random(), pool);
        assert_eq!(a.bridge.len(), 15, "{}", a.bridge);
        assert!(a.bridge.starts_with(&interface_prefix(&node)));
        assert!(b.bridge.starts_with(&interface_prefix(&node)));
        assert_ne!(a.bridge, b.bridge);
        let other = NodeName::parse("node2").unwrap();
        assert_ne!(interface_prefix(&node), interface_prefix(&other));
        assert_eq!(a.labels[LABEL_NODE], node.as_str());
        assert_eq!(
            a.driver_options()["com.docker.network.bridge.enable_icc"],
            "false"
        );
    }

    #[test]
    fn subnets_come_from_the_pool_and_avoid_used_ones() {
        let policy = NetworkPolicy::parse("10.213.0.0/28", &[], &[]).unwrap();
        let session = SessionId::new_random();
        let first = pick_subnet(policy.subnet_pool, session, &[]).unwrap();
        assert_eq!(first.prefix(), 29);
        assert!(policy.subnet_pool.overlaps(&first));
        let second = pick_subnet(policy.subnet_pool, session, &[first]).unwrap();
        assert_ne!(first, second);
        assert_eq!(
            pick_subnet(policy.subnet_pool, session, &[first, second]),
            None
        );
        assert_eq!(
            pick_subnet(policy.subnet_pool, session, &[net("10.0.0.0/8")]),
            None
        );
    }

    proptest! {
        #[test]
        fn picked_subnets_never_overlap_used_ones(used in proptest::collection::vec((0u32..64, 24u8..31), 0..20)) {
            let policy = NetworkPolicy::parse("10.213.0.0/24", &[], &[]).unwrap();
            let used: Vec<Ipv4Net> = used
                .into_iter()
                .filter_map(|(i, p)| {
                    let addr = Ipv4Addr::from(u32::from(Ipv4Addr::new(10, 213, 0, 0)) + i * 4);
                    Ipv4Net::new(Ipv4Addr::from(u32::from(addr) & mask(p)), p)
                })
                .collect();
            if let Some(picked) = pick_subnet(policy.subnet_pool, SessionId::new_random(), &used) {
                prop_assert!(used.iter().all(|u| !u.overlaps(&picked)));
                prop_assert!(policy.subnet_pool.overlaps(&picked));
            }
        }

        #[test]
        fn parsing_never_panics(text in ".{0,30}") {
            let _ = text.parse::<Ipv4Net>();
        }
    }
}
