//! PROXY protocol version 2 (the binary header HAProxy and cloud L4 load balancers send before
//! the client's bytes), so the gateway sees the client's address when it sits behind a
//! balancer. The header itself is parsed and built by the `ppp` crate; this module adds the
//! gateway's policy ([`parse`]: only TCP over IPv4 or IPv6 for `PROXY`, `LOCAL` for the
//! balancer's own health checks, at most [`MAX_BODY_LEN`] bytes after the fixed part, TLVs
//! skipped), [`read_header`], which reads exactly the header off a stream and nothing of the
//! SSH bytes after it, and [`SignatureGuard`], which spots a header sent by a peer that is not
//! trusted to send one. Addresses are returned as sent; the caller normalises IPv4-mapped ones.

use std::net::{IpAddr, SocketAddr};

use ppp::v2::{self as ppp2, Addresses, Command, Protocol};
use tokio::io::{AsyncRead, AsyncReadExt};

/// The 12 bytes every v2 header starts with.
pub const SIGNATURE: [u8; 12] = *b"\r\n\r\n\0\r\nQUIT\n";
/// Signature, version/command, family/transport and the 16-bit length.
pub const FIXED_LEN: usize = 16;
/// The longest address block and TLVs accepted; real balancers send well under this.
pub const MAX_BODY_LEN: usize = 2048;

const FAMILY_TCP4: u8 = 0x11;
const FAMILY_TCP6: u8 = 0x21;

/// What a header says.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Header {
    /// The balancer's own connection (a health check): use the real peer address.
    Local,
    /// A relayed client connection.
    Proxy {
        source: SocketAddr,
        destination: SocketAddr,
    },
}

/// The outcome of [`parse`] on the bytes received so far.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Parsed {
    /// A whole header of `length` bytes; the connection's own bytes follow it.
    Complete { header: Header, length: usize },
    /// At least `needed` bytes in total are required to decide.
    Incomplete { needed: usize },
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ProxyError {
    #[error("the connection does not start with a PROXY protocol v2 header")]
    NoSignature,
    #[error("PROXY protocol version {0} is not supported (only version 2)")]
    Version(u8),
    #[error("PROXY protocol command {0:#x} is unknown")]
    Command(u8),
    #[error(
        "PROXY protocol address family {0:#04x} is not supported (only TCP over IPv4 or IPv6)"
    )]
    Family(u8),
    #[error("PROXY protocol header of {0} bytes is longer than the {MAX_BODY_LEN} accepted")]
    TooLong(usize),
    #[error("PROXY protocol address block of {len} bytes is too short for family {family:#04x}")]
    Truncated { family: u8, len: usize },
    #[error("PROXY protocol header is malformed: {0}")]
    Malformed(String),
}

/// Parses a v2 header at the start of `bytes`.
pub fn parse(bytes: &[u8]) -> Result<Parsed, ProxyError> {
    // The family/transport byte, for messages (present whenever ppp gets that far).
    let family = bytes.get(13).copied().unwrap_or_default();
    let header = match ppp2::Header::try_from(bytes) {
        Ok(header) => header,
        Err(ppp2::ParseError::Incomplete(_)) => {
            return Ok(Parsed::Incomplete { needed: FIXED_LEN })
        }
        Err(ppp2::ParseError::Partial(_, body_len)) => {
            if body_len > MAX_BODY_LEN {
                return Err(ProxyError::TooLong(body_len));
            }
            return Ok(Parsed::Incomplete {
                needed: FIXED_LEN + body_len,
            });
        }
        Err(ppp2::ParseError::Prefix) => return Err(ProxyError::NoSignature),
        Err(ppp2::ParseError::Version(version)) => return Err(ProxyError::Version(version >> 4)),
        Err(ppp2::ParseError::Command(command)) => return Err(ProxyError::Command(command)),
        Err(ppp2::ParseError::AddressFamily(_) | ppp2::ParseError::Protocol(_)) => {
            return Err(ProxyError::Family(family))
        }
        Err(ppp2::ParseError::InvalidAddresses(len, _))
            if family == FAMILY_TCP4 || family == FAMILY_TCP6 =>
        {
            return Err(ProxyError::Truncated { family, len })
        }
        Err(ppp2::ParseError::InvalidAddresses(..)) => return Err(ProxyError::Family(family)),
        Err(other) => return Err(ProxyError::Malformed(other.to_string())),
    };
    let length = header.len();
    if length - FIXED_LEN > MAX_BODY_LEN {
        return Err(ProxyError::TooLong(length - FIXED_LEN));
    }
    let header = match (header.command, header.protocol, header.addresses) {
        (Command::Local, _, _) => Header::Local,
        (Command::Proxy, Protocol::Stream, Addresses::IPv4(ip)) => Header::Proxy {
            source: SocketAddr::new(IpAddr::V4(ip.source_address), ip.source_port),
            destination: SocketAddr::new(IpAddr::V4(ip.destination_address), ip.destination_port),
        },
        (Command::Proxy, Protocol::Stream, Addresses::IPv6(ip)) => Header::Proxy {
            source: SocketAddr::new(IpAddr::V6(ip.source_address), ip.source_port),
            destination: SocketAddr::new(IpAddr::V6(ip.destination_address), ip.destination_port),
        },
        (Command::Proxy, _, _) => return Err(ProxyError::Family(family)),
    };
    Ok(Parsed::Complete { header, length })
}

/// The v2 header for `header` (no TLVs); what a load balancer sends. Mixed families travel as
/// IPv6, the IPv4 address as an IPv4-mapped one.
pub fn encode(header: &Header) -> Vec<u8> {
    let builder = match header {
        Header::Local => ppp2::Builder::with_addresses(
            ppp2::Version::Two | Command::Local,
            Protocol::Unspecified,
            Addresses::Unspecified,
        ),
        Header::Proxy {
            source,
            destination,
        } => {
            let addresses = match (source, destination) {
                (SocketAddr::V4(_), SocketAddr::V4(_)) | (SocketAddr::V6(_), SocketAddr::V6(_)) => {
                    Addresses::from((*source, *destination))
                }
                _ => {
                    let v6 = |address: &SocketAddr| match address.ip() {
                        IpAddr::V4(v4) => v4.to_ipv6_mapped(),
                        IpAddr::V6(v6) => v6,
                    };
                    Addresses::IPv6(ppp2::IPv6::new(
                        v6(source),
                        v6(destination),
                        source.port(),
                        destination.port(),
                    ))
                }
            };
            ppp2::Builder::with_addresses(
                ppp2::Version::Two | Command::Proxy,
                Protocol::Stream,
                addresses,
            )
        }
    };
    builder
        .build()
        .expect("a header without TLVs always fits in a Vec")
}

#[derive(Debug, thiserror::Error)]
pub enum ReadError {
    #[error("reading the PROXY protocol header")]
    Io(#[from] std::io::Error),
    #[error(transparent)]
    Invalid(#[from] ProxyError),
}

/// Reads one header from `reader`, consuming exactly its bytes (the fixed part, then the
/// announced rest), so what follows is the client's own stream. The caller bounds the time.
pub async fn read_header<R: AsyncRead + Unpin>(reader: &mut R) -> Result<Header, ReadError> {
    let mut buffer = vec![0u8; FIXED_LEN];
    reader.read_exact(&mut buffer).await?;
    loop {
        match parse(&buffer)? {
            Parsed::Complete { header, .. } => return Ok(header),
            Parsed::Incomplete { needed } => {
                let have = buffer.len();
                buffer.resize(needed, 0);
                reader.read_exact(&mut buffer[have..]).await?;
            }
        }
    }
}

/// Watches the first bytes a peer sends and tells whether they are a PROXY v2 signature, for
/// peers that are not trusted to send one (their header must be refused, not taken as SSH).
#[derive(Debug, Clone, Default)]
pub struct SignatureGuard {
    seen: usize,
    verdict: Option<bool>,
}

impl SignatureGuard {
    /// Feeds the next bytes received; returns `Some(true)` once a whole signature has been seen,
    /// `Some(false)` once the stream cannot be one, `None` while undecided.
    pub fn feed(&mut self, bytes: &[u8]) -> Option<bool> {
        if self.verdict.is_some() {
            return self.verdict;
        }
        for &byte in bytes {
            if byte != SIGNATURE[self.seen] {
                self.verdict = Some(false);
                return self.verdict;
            }
            self.seen += 1;
            if self.seen == SIGNATURE.len() {
                self.verdict = Some(true);
                return self.verdict;
            }
        }
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use std::net::{Ipv4Addr, Ipv6Addr};

    fn addr(s: &str) -> SocketAddr {
        s.parse().unwrap()
    }

    #[test]
    fn known_headers() {
        // HAProxy's send-proxy-v2 for 10.1.2.3:51000 -> 192.0.2.1:22.
        let mut bytes = SIGNATURE.to_vec();
        bytes.extend_from_slice(&[0x21, 0x11, 0x00, 0x0c]);
        bytes.extend_from_slice(&[10, 1, 2, 3, 192, 0, 2, 1]);
        bytes.extend_from_slice(&51000u16.to_be_bytes());
        bytes.extend_from_slice(&22u16.to_be_bytes());
        bytes.extend_from_slice(b"SSH-2.0-OpenSSH_9.2\r\n");
        assert_eq!(
            parse(&bytes),
            Ok(Parsed::Complete {
                header: Header::Proxy {
                    source: addr("10.1.2.3:51000"),
                    destination: addr("192.0.2.1:22"),
                },
                length: 28,
            })
        );
        // LOCAL with an address block that must be ignored.
        let mut local = SIGNATURE.to_vec();
        local.extend_from_slice(&[0x20, 0x11, 0x00, 0x0c]);
        local.extend_from_slice(&[0; 12]);
        assert_eq!(
            parse(&local),
            Ok(Parsed::Complete {
                header: Header::Local,
                length: 28
            })
        );
        assert_eq!(
            parse(&encode(&Header::Local)),
            Ok(Parsed::Complete {
                header: Header::Local,
                length: FIXED_LEN
            })
        );
        // TLVs after the addresses are skipped (AWS NLB style).
        let mut with_tlv = encode(&Header::Proxy {
            source: addr("[2001:db8::1]:40000"),
            destination: addr("[2001:db8::2]:22"),
        });
        with_tlv[14..16].copy_from_slice(&(36u16 + 5).to_be_bytes());
        with_tlv.extend_from_slice(&[0xea, 0x00, 0x02, b'v', b'p']);
        assert!(matches!(
            parse(&with_tlv),
            Ok(Parsed::Complete { length: 57, .. })
        ));
    }

    #[test]
    fn refusals() {
        assert_eq!(parse(b"SSH-2.0-OpenSSH"), Err(ProxyError::NoSignature));
        assert_eq!(
            parse(b"PROXY TCP4 1.2.3.4 5.6.7.8 1 2\r\n"),
            Err(ProxyError::NoSignature)
        );
        let with = |rest: &[u8]| {
            let mut bytes = SIGNATURE.to_vec();
            bytes.extend_from_slice(rest);
            parse(&bytes)
        };
        assert_eq!(with(&[0x11, 0x11, 0, 0]), Err(ProxyError::Version(1)));
        assert_eq!(with(&[0x22, 0x11, 0, 0]), Err(ProxyError::Command(2)));
        let mut udp = SIGNATURE.to_vec();
        udp.extend_from_slice(&[0x21, 0x12, 0, 12]);
        assert_eq!(parse(&udp), Ok(Parsed::Incomplete { needed: 28 }));
        udp.extend_from_slice(&[0; 12]);
        assert_eq!(parse(&udp), Err(ProxyError::Family(0x12)));
        let mut unix = SIGNATURE.to_vec();
        unix.extend_from_slice(&[0x21, 0x31, 0, 4, 0, 0, 0, 0]);
        assert_eq!(parse(&unix), Err(ProxyError::Family(0x31)));
        assert_eq!(
            with(&[0x21, 0x11, 0xff, 0xff]),
            Err(ProxyError::TooLong(65535))
        );
        let mut short = SIGNATURE.to_vec();
        short.extend_from_slice(&[0x21, 0x11, 0, 4, 1, 2, 3, 4]);
        assert_eq!(
            parse(&short),
            Err(ProxyError::Truncated {
                family: 0x11,
                len: 4
            })
        );
    }

    #[tokio::test]
    async fn read_header_consumes_only_the_header() {
        let header = Header::Proxy {
            source: addr("203.0.113.9:1234"),
            destination: addr("192.0.2.1:2222"),
        };
        let mut bytes = encode(&header);
        bytes.extend_from_slice(b"SSH-2.0-client\r\n");
        let mut reader = &bytes[..];
        assert_eq!(read_header(&mut reader).await.unwrap(), header);
        assert_eq!(reader, b"SSH-2.0-client\r\n");

        let mut reader = &b"SSH-2.0-OpenSSH_9.2p1 Debian\r\n"[..];
        assert!(matches!(
            read_header(&mut reader).await,
            Err(ReadError::Invalid(ProxyError::NoSignature))
        ));
        let mut reader = &SIGNATURE[..6];
        assert!(matches!(
            read_header(&mut reader).await,
            Err(ReadError::Io(_))
        ));
    }

    #[test]
    fn the_guard_spots_a_signature_split_across_reads() {
        let mut guard = SignatureGuard::default();
        assert_eq!(guard.feed(&SIGNATURE[..5]), None);
        assert_eq!(guard.feed(&SIGNATURE[5..]), Some(true));
        let mut guard = SignatureGuard::default();
        assert_eq!(guard.feed(b"SSH-2.0-x\r\n"), Some(false));
        assert_eq!(guard.feed(&SIGNATURE), Some(false), "decided once");
        let mut guard = SignatureGuard::default();
        assert_eq!(guard.feed(b"\r\n\r\n"), None);
        assert_eq!(guard.feed(b"SSH"), Some(false));
    }

    fn socket_addr() -> impl Strategy<Value = SocketAddr> {
        prop_oneof![
            (any::<[u8; 4]>(), any::<u16>())
                .prop_map(|(ip, port)| SocketAddr::new(IpAddr::V4(Ipv4Addr::from(ip)), port)),
            (any::<[u8; 16]>(), any::<u16>())
                .prop_map(|(ip, port)| SocketAddr::new(IpAddr::V6(Ipv6Addr::from(ip)), port)),
        ]
    }

    proptest! {
        #[test]
        fn encode_then_parse_roundtrips(source in socket_addr(), destination in socket_addr(), tail in proptest::collection::vec(any::<u8>(), 0..64)) {
            let header = Header::Proxy { source, destination };
            let mut bytes = encode(&header);
            let length = bytes.len();
            bytes.extend_from_slice(&tail);
            let parsed = parse(&bytes).unwrap();
            let Parsed::Complete { header: got, length: got_length } = parsed else {
                panic!("incomplete: {parsed:?}");
            };
            prop_assert_eq!(got_length, length);
            // Mixed families travel as IPv6, v4 addresses as IPv4-mapped ones.
            let same = |a: SocketAddr, b: SocketAddr| {
                a.port() == b.port()
                    && ongrid_core::normalize_ip(a.ip()) == ongrid_core::normalize_ip(b.ip())
            };
            let Header::Proxy { source: s, destination: d } = got else { panic!("local") };
            prop_assert!(same(s, source) && same(d, destination));
        }

        #[test]
        fn every_prefix_of_a_header_is_incomplete(source in socket_addr(), destination in socket_addr(), cut in 0usize..52) {
            let bytes = encode(&Header::Proxy { source, destination });
            let cut = cut.min(bytes.len() - 1);
            let parsed = parse(&bytes[..cut]);
            prop_assert!(matches!(parsed, Ok(Parsed::Incomplete { needed }) if needed > cut), "{:?}", parsed);
        }

        #[test]
        fn parse_never_panics(bytes in proptest::collection::vec(any::<u8>(), 0..96)) {
            let _ = parse(&bytes);
        }

        #[test]
        fn parse_never_panics_after_a_signature(rest in proptest::collection::vec(any::<u8>(), 0..96)) {
            let mut bytes = SIGNATURE.to_vec();
            bytes.extend_from_slice(&rest);
            if let Ok(Parsed::Complete { length, .. }) = parse(&bytes) {
                prop_assert!(length <= bytes.len());
            }
        }
    }
}
