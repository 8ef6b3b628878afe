//! Networks of allowed institutes: CIDR ranges (IPv4 and IPv6), institute names, and the
//! normalisation of peer addresses (an IPv4-mapped IPv6 address is its IPv4 address).

use std::fmt;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};
use std::str::FromStr;

use serde::{Deserialize, Serialize};

/// `::ffff:a.b.c.d` → `a.b.c.d`; every other address unchanged. Apply to every peer address
/// before matching, or IPv4 clients of a dual-stack listener never match IPv4 ranges.
pub fn normalize_ip(ip: IpAddr) -> IpAddr {
    match ip {
        IpAddr::V6(v6) => match v6.to_ipv4_mapped() {
            Some(v4) => IpAddr::V4(v4),
            None => IpAddr::V6(v6),
        },
        v4 => v4,
    }
}

/// An IP network: address and prefix length, with no host bits set (`10.1.0.0/16`,
/// `2001:db8::/32`). A bare address is a /32 or /128.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(try_from = "String", into = "String")]
pub struct Cidr {
    network: IpAddr,
    prefix: u8,
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum CidrError {
    #[error("{0:?} is not an IP network: write it like 192.0.2.0/24 or 2001:db8::/32")]
    Malformed(String),
    #[error("{value:?} has prefix length {prefix}, more than {max} for this address family")]
    PrefixTooLong { value: String, prefix: u8, max: u8 },
    #[error("{value:?} has host bits set: the network is {network}")]
    HostBitsSet { value: String, network: String },
    #[error(
        "{value} can never match: IPv4-mapped IPv6 peers are matched as their IPv4 address; \
         write {fix}"
    )]
    NeverMatches { value: String, fix: String },
    #[error(
        "{value} can never match: it is made of IPv4-compatible IPv6 addresses (::a.b.c.d, \
         deprecated by RFC 4291), which no peer connects from; write {fix}"
    )]
    Ipv4Compatible { value: String, fix: String },
}

impl Cidr {
    pub fn parse(value: &str) -> Result<Self, CidrError> {
        let trimmed = value.trim();
        let (addr, prefix) = match trimmed.split_once('/') {
            Some((addr, prefix)) => (addr, Some(prefix)),
            None => (trimmed, None),
        };
        let addr: IpAddr = addr
            .parse()
            .map_err(|_| CidrError::Malformed(value.to_owned()))?;
        let max = if addr.is_ipv4() { 32 } else { 128 };
        let prefix = match prefix {
            None => max,
            Some(p) if !p.is_empty() && p.len() <= 3 && p.bytes().all(|b| b.is_ascii_digit()) => p
                .parse::<u8>()
                .map_err(|_| CidrError::Malformed(value.to_owned()))?,
            Some(_) => return Err(CidrError::Malformed(value.to_owned())),
        };
        if prefix > max {
            return Err(CidrError::PrefixTooLong {
                value: value.to_owned(),
                prefix,
                max,
            });
        }
        let network = mask(addr, prefix);
        if network != addr {
            return Err(CidrError::HostBitsSet {
                value: value.to_owned(),
                network: Cidr { network, prefix }.to_string(),
            });
        }
        Ok(Self { network, prefix })
    }

    pub fn network(&self) -> IpAddr {
        self.network
    }

    pub fn prefix(&self) -> u8 {
        self.prefix
    }

    /// Refuses a network no peer can ever be in: one inside `::ffff:0:0/96`, the IPv4-mapped
    /// addresses, which [`normalize_ip`] turns into IPv4 before matching. The error names the
    /// IPv4 network to write instead. (Not part of [`Cidr::parse`], so networks stored before
    /// this rule still load; the admin API checks new ones.)
    pub fn check_matchable(&self) -> Result<(), CidrError> {
        let IpAddr::V6(v6) = self.network else {
            return Ok(());
        };
        if self.prefix < 96 {
            return Ok(());
        }
        let fix = |v4: Ipv4Addr| format!("{v4}/{}", self.prefix - 96);
        if let Some(v4) = v6.to_ipv4_mapped() {
            return Err(CidrError::NeverMatches {
                value: self.to_string(),
                fix: fix(v4),
            });
        }
        // Inside ::/96, only :: and the loopback ::1 are real IPv6 addresses.
        let segments = v6.segments();
        let loopback = IpAddr::V6(Ipv6Addr::LOCALHOST);
        if segments[..6].iter().all(|&s| s == 0) && !self.contains(loopback) {
            let v4 = Ipv4Addr::from(u128::from(v6) as u32);
            return Err(CidrError::Ipv4Compatible {
                value: self.to_string(),
                fix: fix(v4),
            });
        }
        Ok(())
    }

    /// Whether `ip` (normalised first) lies in this network.
    pub fn contains(&self, ip: IpAddr) -> bool {
        let ip = normalize_ip(ip);
        ip.is_ipv4() == self.network.is_ipv4() && mask(ip, self.prefix) == self.network
    }
}

fn mask(addr: IpAddr, prefix: u8) -> IpAddr {
    match addr {
        IpAddr::V4(v4) => {
            let bits = u32::from(v4);
            let m = if prefix == 0 {
                0
            } else {
                u32::MAX << (32 - u32::from(prefix))
            };
            IpAddr::V4(Ipv4Addr::from(bits & m))
        }
        IpAddr::V6(v6) => {
            let bits = u128::from(v6);
            let m = if prefix == 0 {
                0
            } else {
                u128::MAX << (128 - u32::from(prefix))
            };
            IpAddr::V6(Ipv6Addr::from(bits & m))
        }
    }
}

impl fmt::Display for Cidr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.network, self.prefix)
    }
}

impl FromStr for Cidr {
    type Err = CidrError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Self::parse(s)
    }
}

impl TryFrom<String> for Cidr {
    type Error = CidrError;
    fn try_from(value: String) -> Result<Self, Self::Error> {
        Self::parse(&value)
    }
}

impl From<Cidr> for String {
    fn from(value: Cidr) -> Self {
        value.to_string()
    }
}

/// An institute's name as admins give it: 1 to 64 characters of lower-case letters, digits,
/// `-`, `_` and `.`, starting with a letter or digit (`uni-glasgow`, `cern.ch`).
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(try_from = "String", into = "String")]
pub struct InstituteName(String);

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("institute name {0:?} must be 1 to 64 lower-case letters, digits, '-', '_' or '.', starting with a letter or digit")]
pub struct InstituteNameError(String);

impl InstituteName {
    pub fn parse(value: &str) -> Result<Self, InstituteNameError> {
        let ok = !value.is_empty()
            && value.len() <= 64
            && value.bytes().all(|b| {
                b.is_ascii_lowercase() || b.is_ascii_digit() || matches!(b, b'-' | b'_' | b'.')
            })
            && value.as_bytes()[0].is_ascii_alphanumeric();
        if ok {
            Ok(Self(value.to_owned()))
        } else {
            Err(InstituteNameError(value.to_owned()))
        }
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl fmt::Display for InstituteName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl FromStr for InstituteName {
    type Err = InstituteNameError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Self::parse(s)
    }
}

impl TryFrom<String> for InstituteName {
    type Error = InstituteNameError;
    fn try_from(value: String) -> Result<Self, Self::Error> {
        Self::parse(&value)
    }
}

impl From<InstituteName> for String {
    fn from(value: InstituteName) -> Self {
        value.0
    }
}

/// An allowed institute: its name and networks.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Institute {
    pub name: InstituteName,
    pub cidrs: Vec<Cidr>,
}

/// The allowlist: which institute, if any, a peer address belongs to.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Allowlist {
    pub institutes: Vec<Institute>,
}

impl Allowlist {
    /// The institute whose networks contain `ip` (normalised), the most specific match first
    /// (longest prefix, then name), or `None` when the address is not allowed.
    pub fn institute_of(&self, ip: IpAddr) -> Option<&InstituteName> {
        let ip = normalize_ip(ip);
        self.institutes
            .iter()
            .flat_map(|inst| inst.cidrs.iter().map(move |c| (c, &inst.name)))
            .filter(|(cidr, _)| cidr.contains(ip))
            .max_by(|(a, an), (b, bn)| a.prefix().cmp(&b.prefix()).then_with(|| bn.cmp(an)))
            .map(|(_, name)| name)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn ip(s: &str) -> IpAddr {
        s.parse().unwrap()
    }

    #[test]
    fn cidrs() {
        let net = Cidr::parse("10.1.0.0/16").unwrap();
        assert!(net.contains(ip("10.1.255.3")));
        assert!(!net.contains(ip("10.2.0.1")));
        assert!(
            net.contains(ip("::ffff:10.1.2.3")),
            "IPv4-mapped IPv6 must match"
        );
        assert_eq!(
            Cidr::parse("192.0.2.7").unwrap().to_string(),
            "192.0.2.7/32"
        );
        assert!(Cidr::parse("0.0.0.0/0")
            .unwrap()
            .contains(ip("203.0.113.9")));
        assert!(!Cidr::parse("0.0.0.0/0")
            .unwrap()
            .contains(ip("2001:db8::1")));
        let v6 = Cidr::parse("2001:db8::/32").unwrap();
        assert!(v6.contains(ip("2001:db8:1::5")));
        assert!(!v6.contains(ip("2001:db9::5")));
        assert!(matches!(
            Cidr::parse("10.1.2.3/16"),
            Err(CidrError::HostBitsSet { .. })
        ));
        let err = Cidr::parse("10.1.2.3/16").unwrap_err().to_string();
        assert!(err.contains("10.1.0.0/16"), "{err}");
        assert!(matches!(
            Cidr::parse("10.0.0.0/33"),
            Err(CidrError::PrefixTooLong { .. })
        ));
        assert!(matches!(
            Cidr::parse("10.0.0/8"),
            Err(CidrError::Malformed(_))
        ));
        assert!(matches!(
            Cidr::parse("10.0.0.0/"),
            Err(CidrError::Malformed(_))
        ));
        assert!(matches!(
            Cidr::parse("10.0.0.0/-1"),
            Err(CidrError::Malformed(_))
        ));
        assert!(matches!(
            Cidr::parse("example.org/8"),
            Err(CidrError::Malformed(_))
        ));
    }

    #[test]
    fn institute_names() {
        assert!(InstituteName::parse("uni-glasgow").is_ok());
        assert!(InstituteName::parse("cern.ch").is_ok());
        assert!(InstituteName::parse("-x").is_err());
        assert!(InstituteName::parse("Uni").is_err());
        assert!(InstituteName::parse("").is_err());
    }

    #[test]
    fn allowlist_prefers_the_most_specific_network() {
        let list = Allowlist {
            institutes: vec![
                Institute {
                    name: InstituteName::parse("wide").unwrap(),
                    cidrs: vec![Cidr::parse("10.0.0.0/8").unwrap()],
                },
                Institute {
                    name: InstituteName::parse("lab").unwrap(),
                    cidrs: vec![
                        Cidr::parse("10.5.0.0/16").unwrap(),
                        Cidr::parse("2001:db8::/32").unwrap(),
                    ],
                },
            ],
        };
        assert_eq!(
            list.institute_of(ip("10.5.1.1")).map(InstituteName::as_str),
            Some("lab")
        );
        assert_eq!(
            list.institute_of(ip("10.6.1.1")).map(InstituteName::as_str),
            Some("wide")
        );
        assert_eq!(
            list.institute_of(ip("::ffff:10.6.1.1"))
                .map(InstituteName::as_str),
            Some("wide")
        );
        assert_eq!(
            list.institute_of(ip("2001:db8::9"))
                .map(InstituteName::as_str),
            Some("lab")
        );
        assert_eq!(list.institute_of(ip("192.0.2.1")), None);
        assert_eq!(Allowlist::default().institute_of(ip("127.0.0.1")), None);
    }

    #[test]
    fn only_networks_a_peer_can_be_in_are_matchable() {
        let check = |value: &str| Cidr::parse(value).unwrap().check_matchable();
        for fine in ["::1/128", "::/0", "::/96", "2001:db8::/32", "127.0.0.2/32"] {
            assert_eq!(check(fine), Ok(()), "{fine}");
        }
        let err = check("::127.0.0.2/128").unwrap_err().to_string();
        assert!(err.contains("write 127.0.0.2/32"), "{err}");
        let err = check("::ffff:127.0.0.2/128").unwrap_err().to_string();
        assert!(err.contains("write 127.0.0.2/32"), "{err}");
    }

    proptest! {
        #[test]
        fn mapped_networks_never_match_and_their_fix_does(a: u32, prefix in 96u8..=128) {
            let v4 = Ipv4Addr::from(a);
            let v4_prefix = prefix - 96;
            let network = mask(IpAddr::V6(v4.to_ipv6_mapped()), prefix);
            let cidr = Cidr::parse(&format!("{network}/{prefix}")).unwrap();
            prop_assert!(!cidr.contains(IpAddr::V6(v4.to_ipv6_mapped())));
            let err = cidr.check_matchable().unwrap_err().to_string();
            let fixed = mask(IpAddr::V4(v4), v4_prefix);
            prop_assert!(err.contains(&format!("write {fixed}/{v4_prefix}")), "{}", err);
            let fix = Cidr::parse(&format!("{fixed}/{v4_prefix}")).unwrap();
            prop_assert!(fix.contains(IpAddr::V6(v4.to_ipv6_mapped())));
        }

        #[test]
        fn ipv4_compatible_networks_are_refused_with_their_ipv4_fix(a in 2u32.., prefix in 96u8..=128) {
            let v4 = Ipv4Addr::from(a);
            let network = mask(IpAddr::V6(v4.to_ipv6_compatible()), prefix);
            let cidr = Cidr::parse(&format!("{network}/{prefix}")).unwrap();
            let fixed = mask(IpAddr::V4(v4), prefix - 96);
            match cidr.check_matchable() {
                // A network this wide still holds the loopback ::1, which peers do use.
                Ok(()) => prop_assert!(cidr.contains(IpAddr::V6(Ipv6Addr::LOCALHOST))),
                Err(err) => {
                    let err = err.to_string();
                    prop_assert!(err.contains("IPv4-compatible"), "{}", err);
                    prop_assert!(err.contains(&format!("write {fixed}/{}", prefix - 96)), "{}", err);
                }
            }
        }

        #[test]
        fn parse_never_panics(s in "\\PC{0,50}") {
            let _ = Cidr::parse(&s);
        }

        #[test]
        fn a_network_contains_its_own_addresses(bits in any::<u32>(), prefix in 0u8..=32, host in any::<u32>()) {
            let network = mask(IpAddr::V4(Ipv4Addr::from(bits)), prefix);
            let cidr = Cidr::parse(&format!("{network}/{prefix}")).unwrap();
            let host_mask = if prefix == 32 { 0 } else { u32::MAX >> prefix };
            let IpAddr::V4(n) = network else { unreachable!() };
            let inside = Ipv4Addr::from(u32::from(n) | (host & host_mask));
            prop_assert!(cidr.contains(IpAddr::V4(inside)));
            prop_assert_eq!(Cidr::parse(&cidr.to_string()).unwrap(), cidr);
        }
    }
}
