//! Verification of a presented certificate chain: an end-entity certificate (EEC) issued by a CA
//! in the trusted directory, optionally with RFC 3820 proxies below it, as TLS clients send it
//! (leaf first, the rest in any order, perhaps with the CA).
//!
//! Order of the checks: parse and order the chain (refusing legacy and draft proxies with a
//! message that says how to make an RFC proxy), then the EEC up to a trusted CA (signatures,
//! validity, CA constraints, CRLs), then each proxy from the EEC down (research doc
//! `x509_proxies.md` A.1.2). Every rule has its own [`ChainError`] variant. Time is
//! `VerifyOptions::now`; nothing here reads the clock.

use std::collections::HashSet;
use std::time::Duration;

use chrono::{DateTime, TimeDelta, Utc};
use ongrid_core::Dn;
use x509_parser::extensions::ParsedExtension;
use x509_parser::prelude::{FromDer, X509Certificate};
use x509_parser::revocation_list::CertificateRevocationList;
use x509_parser::time::ASN1Time;
use x509_parser::x509::X509Name;

use crate::cadir::CaDir;
use crate::der::{self, DerError, TAG_INTEGER, TAG_OCTET_STRING, TAG_OID, TAG_SEQUENCE};
use crate::dn::{self, Rdns};
use crate::sig::{self, SigError};

/// RFC 3820 ProxyCertInfo.
pub(crate) const OID_PCI_RFC: &str = "1.3.6.1.5.5.7.1.14";
/// The GT3 draft ProxyCertInfo.
pub(crate) const OID_PCI_DRAFT: &str = "1.3.6.1.4.1.3536.1.222";
/// The VOMS attribute certificate sequence, carried by proxies.
pub(crate) const OID_VOMS_ACSEQ: &str = "1.3.6.1.4.1.8005.100.100.5";
const OID_PPL_INHERIT_ALL: &str = "1.3.6.1.5.5.7.21.1";
const OID_PPL_INDEPENDENT: &str = "1.3.6.1.5.5.7.21.2";
const OID_PPL_LIMITED: &str = "1.3.6.1.4.1.3536.1.1.1.9";
const OID_BASIC_CONSTRAINTS: &str = "2.5.29.19";
const OID_KEY_USAGE: &str = "2.5.29.15";
const OID_EXT_KEY_USAGE: &str = "2.5.29.37";
const OID_SKI: &str = "2.5.29.14";
const OID_AKI: &str = "2.5.29.35";
const OID_SAN: &str = "2.5.29.17";
const OID_IAN: &str = "2.5.29.18";
const OID_CERT_POLICIES: &str = "2.5.29.32";
const OID_POLICY_CONSTRAINTS: &str = "2.5.29.36";
const OID_INHIBIT_ANY_POLICY: &str = "2.5.29.54";
const OID_CRL_DP: &str = "2.5.29.31";
const OID_AIA: &str = "1.3.6.1.5.5.7.1.1";
const OID_NETSCAPE_CERT_TYPE: &str = "2.16.840.1.113730.1.1";
const OID_CN: &str = "2.5.4.3";

/// Critical extensions a proxy may carry (Globus `check_critical_extensions`).
const PROXY_CRITICAL_OK: &[&str] = &[
    OID_BASIC_CONSTRAINTS,
    OID_KEY_USAGE,
    OID_EXT_KEY_USAGE,
    OID_SKI,
    OID_AKI,
    OID_NETSCAPE_CERT_TYPE,
    OID_PCI_RFC,
];
/// Critical extensions an end-entity certificate may carry.
const EEC_CRITICAL_OK: &[&str] = &[
    OID_BASIC_CONSTRAINTS,
    OID_KEY_USAGE,
    OID_EXT_KEY_USAGE,
    OID_SKI,
    OID_AKI,
    OID_SAN,
    OID_CERT_POLICIES,
    OID_CRL_DP,
    OID_AIA,
    OID_NETSCAPE_CERT_TYPE,
];
/// Critical extensions a CA may carry (no nameConstraints: not enforced here, so refused).
const CA_CRITICAL_OK: &[&str] = &[
    OID_BASIC_CONSTRAINTS,
    OID_KEY_USAGE,
    OID_EXT_KEY_USAGE,
    OID_SKI,
    OID_AKI,
    OID_CERT_POLICIES,
    OID_POLICY_CONSTRAINTS,
    OID_INHIBIT_ANY_POLICY,
    OID_CRL_DP,
    OID_AIA,
    OID_NETSCAPE_CERT_TYPE,
];

/// Longest chain accepted (proxies plus EEC), and longest CA path.
const MAX_PROXIES: usize = 16;
const MAX_CA_DEPTH: usize = 8;

/// What to do with a CRL whose nextUpdate has passed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CrlPolicy {
    /// Refuse every certificate issued by that CA until the CRL is updated.
    Refuse,
    /// Use the stale CRL anyway and add a warning.
    Warn,
}

/// How to verify: the time, the tolerated clock skew and the site's policy choices.
#[derive(Debug, Clone)]
pub struct VerifyOptions {
    pub now: DateTime<Utc>,
    /// Tolerance on both ends of every validity period (grid tools backdate proxies by 5 min).
    pub clock_skew: Duration,
    pub crl_policy: CrlPolicy,
    /// Smallest RSA key accepted anywhere in the chain.
    pub min_rsa_bits: u32,
    /// Whether independent proxies (own identity) are accepted.
    pub allow_independent: bool,
}

impl VerifyOptions {
    /// The defaults at time `now`: 5 minutes skew, stale CRLs refused, RSA ≥ 2048 bits,
    /// independent proxies accepted.
    pub fn at(now: DateTime<Utc>) -> Self {
        Self {
            now,
            clock_skew: Duration::from_secs(300),
            crl_policy: CrlPolicy::Refuse,
            min_rsa_bits: 2048,
            allow_independent: true,
        }
    }
}

/// What kind of credential was presented.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ProxyKind {
    /// A plain user (or host) certificate, no proxy.
    EndEntity,
    /// An RFC 3820 impersonation proxy (inheritAll): acts as the user.
    Impersonation,
    /// A limited proxy: acts as the user, but should not start jobs or processes.
    Limited,
    /// The identity is an independent proxy's own subject.
    Independent,
}

/// A chain that passed every rule.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct VerifiedChain {
    /// Who this is: the EEC subject, or the subject of the independent proxy nearest the leaf.
    pub identity: Dn,
    pub end_entity_subject: Dn,
    pub end_entity_issuer: Dn,
    /// The EEC's serial number, without leading zero octets (VOMS AC holders name it).
    pub end_entity_serial: Vec<u8>,
    /// The leaf proxy's kind; Limited wins, then Independent when the identity comes from one.
    pub kind: ProxyKind,
    /// The earliest notAfter of the EEC and the proxies.
    pub not_after: DateTime<Utc>,
    /// The number of proxies.
    pub depth: usize,
    /// The leaf's SubjectPublicKeyInfo (DER), for checking the TLS handshake signature.
    pub leaf_public_key_spki: Vec<u8>,
    /// Things that did not stop verification but an operator should know.
    pub warnings: Vec<String>,
    /// The raw values of the VOMS AC extensions of the proxies, leaf first.
    pub voms_der: Vec<Vec<u8>>,
}

/// Why a chain was refused: one variant per rule, each message naming the fix.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ChainError {
    #[error("no client certificate was presented: present your proxy (voms-proxy-init) or your user certificate")]
    Empty,
    #[error("certificate {index} of the presented chain is not valid X.509 ({reason}): present a proxy made by voms-proxy-init or grid-proxy-init")]
    Malformed { index: usize, reason: String },
    #[error(
        "the chain has more than {max} proxies: make a fresh proxy from your user certificate"
    )]
    TooLong { max: usize },
    #[error("proxy {subject} came without the certificate of its issuer {issuer}: present the whole proxy file (it holds the proxies and your user certificate)")]
    MissingIssuer { subject: String, issuer: String },
    #[error("{subject} is a legacy (pre-RFC 3820) proxy, which is not accepted: make an RFC 3820 proxy with `voms-proxy-init -rfc` or `grid-proxy-init -rfc`")]
    LegacyProxy { subject: String },
    #[error("{subject} is a draft (GT3, pre-RFC 3820) proxy, which is not accepted: make an RFC 3820 proxy with `voms-proxy-init -rfc` or `grid-proxy-init -rfc`")]
    DraftProxy { subject: String },
    #[error("proxy {subject} has a non-critical ProxyCertInfo extension (RFC 3820 requires it critical): make a new proxy with voms-proxy-init or grid-proxy-init")]
    NonCriticalPci { subject: String },
    #[error("proxy {subject} has more than one ProxyCertInfo extension: make a new proxy with voms-proxy-init or grid-proxy-init")]
    DuplicatePci { subject: String },
    #[error("proxy {subject} has a malformed ProxyCertInfo extension ({reason}): make a new proxy with voms-proxy-init or grid-proxy-init")]
    BadPci { subject: String, reason: String },
    #[error("certificate {subject} has the extension {oid} more than once: it is malformed; make a new proxy or ask your CA")]
    DuplicateExtension { subject: String, oid: String },
    #[error("proxy {subject} breaks the proxy name rule ({reason}): a proxy's subject is its issuer's subject {issuer} plus one CN; make a new proxy with voms-proxy-init or grid-proxy-init")]
    ProxySubject {
        subject: String,
        issuer: String,
        reason: String,
    },
    #[error("proxy {subject} is signed by {issuer}, a CA certificate: proxies must be signed by a user certificate or another proxy")]
    IssuerIsCa { subject: String, issuer: String },
    #[error("proxy {subject} is signed by {issuer}, whose key usage does not allow digital signatures: make proxies from a user certificate with the digitalSignature key usage")]
    IssuerKeyUsage { subject: String, issuer: String },
    #[error("proxy {subject} has a {extension} extension, which proxies must not have (RFC 3820): make a new proxy with voms-proxy-init or grid-proxy-init")]
    ProxyAltName { subject: String, extension: String },
    #[error("proxy {subject} claims to be a CA (basicConstraints cA=TRUE), which proxies must not: make a new proxy with voms-proxy-init or grid-proxy-init")]
    ProxyIsCa { subject: String },
    #[error("proxy {subject} is beyond the proxy path length allowed by the proxies above it: make the proxy from your user certificate or from a proxy that allows further delegation")]
    PathLenExceeded { subject: String },
    #[error("proxy {subject} is a full proxy signed by a limited proxy: a proxy of a limited proxy must be limited too (grid-proxy-init -limited)")]
    FullProxyFromLimited { subject: String },
    #[error("proxy {subject} uses the policy language {oid}, which is not accepted: use a normal (inheritAll), limited or independent proxy")]
    UnknownPolicyLanguage { subject: String, oid: String },
    #[error("proxy {subject} is an independent proxy, which this service does not accept: make a normal proxy (without -independent)")]
    IndependentNotAllowed { subject: String },
    #[error("certificate {subject} has the critical extension {oid}, which is not understood here: make a new proxy with voms-proxy-init or grid-proxy-init (or ask your CA about the certificate)")]
    UnknownCriticalExtension { subject: String, oid: String },
    #[error("the signature on {subject} does not verify with the key of {issuer}: the chain was altered or its certificates mixed up; make a new proxy")]
    BadSignature { subject: String, issuer: String },
    #[error("{subject} is signed with SHA-1, which is no longer accepted: make a new proxy (or ask your CA for a new certificate)")]
    Sha1Signature { subject: String },
    #[error("{subject} is signed with the algorithm {oid}, which is not supported (RSA PKCS#1 with SHA-2, ECDSA P-256/P-384 and Ed25519 are): make a new proxy")]
    UnsupportedSignatureAlgorithm { subject: String, oid: String },
    #[error("{subject} has a {bits}-bit RSA key, below the {min} bits required: make a new proxy with at least {min} bits (voms-proxy-init -bits {min}) or get a new certificate")]
    WeakKey {
        subject: String,
        bits: u32,
        min: u32,
    },
    #[error("proxy expired at {at}: run voms-proxy-init (or grid-proxy-init) to make a new one")]
    ProxyExpired { subject: String, at: String },
    #[error(
        "user certificate {subject} expired at {at}: renew it with your CA, then make a new proxy"
    )]
    CertificateExpired { subject: String, at: String },
    #[error("{subject} is not valid before {from}: check the clocks of this machine and of the one where the proxy was made")]
    NotYetValid { subject: String, from: String },
    #[error("issuer {issuer} of {subject} is not a trusted CA in {dir}: install its CA certificate there (IGTF bundle) or use a certificate from a trusted CA")]
    UnknownCa {
        subject: String,
        issuer: String,
        dir: String,
    },
    #[error("CA certificate {subject} in {dir} cannot issue certificates ({reason}): fix the CA directory")]
    NotACa {
        subject: String,
        dir: String,
        reason: String,
    },
    #[error("CA {subject} allows at most {max} intermediate CAs below it, but the chain has more: fix the CA directory")]
    CaPathLen { subject: String, max: u32 },
    #[error("CA certificate {subject} expired at {at}: update the CA bundle in {dir}")]
    CaExpired {
        subject: String,
        at: String,
        dir: String,
    },
    #[error("certificate {subject} (serial {serial}) was revoked by its CA {ca}: ask your CA for a new certificate")]
    Revoked {
        subject: String,
        serial: String,
        ca: String,
    },
    #[error("the CRL of CA {ca} in {dir} is out of date (next update was due {at}): run fetch-crl to update it")]
    CrlExpired { ca: String, dir: String, at: String },
    #[error("the CRL of CA {ca} in {dir} does not verify with the CA's key: run fetch-crl to download it again")]
    CrlBadSignature { ca: String, dir: String },
    #[error("{subject} is a CA certificate, not a user certificate: present your proxy or your user certificate")]
    EndEntityIsCa { subject: String },
}

/// The policy of a proxy.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Policy {
    InheritAll,
    Independent,
    Limited,
}

/// A decoded RFC 3820 ProxyCertInfo.
#[derive(Debug, Clone, PartialEq, Eq)]
struct ProxyCertInfo {
    path_len: Option<u64>,
    language: String,
}

/// Decodes an RFC 3820 ProxyCertInfo:
/// `SEQUENCE { pCPathLenConstraint INTEGER OPTIONAL, proxyPolicy SEQUENCE { policyLanguage OID,
/// policy OCTET STRING OPTIONAL } }`.
fn decode_pci(value: &[u8]) -> Result<ProxyCertInfo, DerError> {
    let outer = der::single(value, TAG_SEQUENCE)?;
    let mut reader = outer.reader();
    let path_len = match reader.optional(TAG_INTEGER)? {
        Some(int) => Some(der::small_uint(int.value)?),
        None => None,
    };
    let policy = reader.expect(TAG_SEQUENCE)?;
    reader.finish()?;
    let mut policy_reader = policy.reader();
    let language = der::oid_string(policy_reader.expect(TAG_OID)?.value)?;
    policy_reader.optional(TAG_OCTET_STRING)?;
    policy_reader.finish()?;
    Ok(ProxyCertInfo { path_len, language })
}

/// Verifies `chain_der` (leaf first, as TLS sends it) against the trusted CAs.
pub fn verify_chain(
    chain_der: &[Vec<u8>],
    cas: &CaDir,
    opts: &VerifyOptions,
) -> Result<VerifiedChain, ChainError> {
    if chain_der.is_empty() {
        return Err(ChainError::Empty);
    }
    let mut certs = Vec::with_capacity(chain_der.len());
    for (index, der) in chain_der.iter().enumerate() {
        let (_, cert) = X509Certificate::from_der(der).map_err(|e| ChainError::Malformed {
            index,
            reason: e.to_string(),
        })?;
        certs.push(cert);
    }
    let path = order_chain(&certs)?;
    let (&eec_index, proxy_indices) = path.split_last().ok_or(ChainError::Empty)?;
    let eec = &certs[eec_index];
    // The proxies from the EEC down to the leaf.
    let proxies: Vec<&X509Certificate<'_>> =
        proxy_indices.iter().rev().map(|i| &certs[*i]).collect();
    // Legacy and draft proxies first: their fix is a different command line.
    for proxy in proxies.iter().rev() {
        generation(proxy)?;
    }

    let mut warnings = Vec::new();
    let checker = Checker { cas, opts };
    if proxies.is_empty() && is_ca(eec) {
        return Err(ChainError::EndEntityIsCa {
            subject: subject_of(eec),
        });
    }
    checker.end_entity(eec, &mut warnings)?;

    let policies = proxy_policies(&checker, eec, &proxies)?;

    let leaf = &certs[path[0]];
    let to_dn = |name: &X509Name<'_>| {
        dn::name_to_dn(name).map_err(|e| ChainError::Malformed {
            index: 0,
            reason: e.to_string(),
        })
    };
    let end_entity_subject = to_dn(eec.subject())?;
    let independent = policies
        .iter()
        .rposition(|p| *p == Policy::Independent)
        .and_then(|i| proxies.get(i));
    let identity = match independent {
        Some(proxy) => to_dn(proxy.subject())?,
        None => end_entity_subject.clone(),
    };
    let kind = match policies.last() {
        None => ProxyKind::EndEntity,
        Some(Policy::Limited) => ProxyKind::Limited,
        Some(_) if independent.is_some() => ProxyKind::Independent,
        Some(_) => ProxyKind::Impersonation,
    };
    let not_after = std::iter::once(eec)
        .chain(proxies.iter().copied())
        .map(|c| not_after_of(c))
        .min()
        .unwrap_or(opts.now);
    let voms_der = proxies
        .iter()
        .rev()
        .flat_map(|p| p.extensions().iter())
        .filter(|e| e.oid.to_id_string() == OID_VOMS_ACSEQ)
        .map(|e| e.value.to_vec())
        .collect();
    Ok(VerifiedChain {
        identity,
        end_entity_issuer: to_dn(eec.issuer())?,
        end_entity_serial: der::strip_leading_zeros(eec.raw_serial()).to_vec(),
        end_entity_subject,
        kind,
        not_after,
        depth: proxies.len(),
        leaf_public_key_spki: leaf.public_key().raw.to_vec(),
        warnings,
        voms_der,
    })
}

/// Checks each proxy from the end entity down against its issuer (signature, times, its proxy
/// extension) and the chain's rules on them: the path length each allows, a known policy
/// language, no full proxy below a limited one, an independent one only when allowed. Their
/// policies, in the same order.
fn proxy_policies(
    checker: &Checker<'_>,
    eec: &X509Certificate<'_>,
    proxies: &[&X509Certificate<'_>],
) -> Result<Vec<Policy>, ChainError> {
    let mut remaining: Option<u64> = None;
    let mut policies = Vec::with_capacity(proxies.len());
    let mut issuer = eec;
    for (i, proxy) in proxies.iter().enumerate() {
        let pci = checker.proxy(proxy, issuer)?;
        let subject = || subject_of(proxy);
        if i > 0 {
            match remaining {
                Some(0) => return Err(ChainError::PathLenExceeded { subject: subject() }),
                Some(n) => remaining = Some(n - 1),
                None => {}
            }
        }
        if let Some(n) = pci.path_len {
            remaining = Some(remaining.map_or(n, |r| r.min(n)));
        }
        let policy = match pci.language.as_str() {
            OID_PPL_INHERIT_ALL => Policy::InheritAll,
            OID_PPL_INDEPENDENT => Policy::Independent,
            OID_PPL_LIMITED => Policy::Limited,
            other => {
                return Err(ChainError::UnknownPolicyLanguage {
                    subject: subject(),
                    oid: other.to_owned(),
                })
            }
        };
        if policy == Policy::InheritAll && policies.last() == Some(&Policy::Limited) {
            return Err(ChainError::FullProxyFromLimited { subject: subject() });
        }
        if policy == Policy::Independent && !checker.opts.allow_independent {
            return Err(ChainError::IndependentNotAllowed { subject: subject() });
        }
        policies.push(policy);
        issuer = proxy;
    }
    Ok(policies)
}

/// Orders the presented certificates: the leaf, then each proxy's issuer among the presented
/// ones, until the first certificate that is not a proxy (the EEC). Returns indices, leaf first.
fn order_chain(certs: &[X509Certificate<'_>]) -> Result<Vec<usize>, ChainError> {
    let mut path = vec![0];
    let mut used = HashSet::from([0]);
    loop {
        let current = &certs[*path.last().ok_or(ChainError::Empty)?];
        if !looks_like_proxy(current) {
            return Ok(path);
        }
        if path.len() > MAX_PROXIES {
            return Err(ChainError::TooLong { max: MAX_PROXIES });
        }
        let issuer_name = dn::display_name(current.issuer());
        let next = certs
            .iter()
            .enumerate()
            .find(|(i, c)| !used.contains(i) && dn::display_name(c.subject()) == issuer_name)
            .map(|(i, _)| i);
        let Some(next) = next else {
            return Err(ChainError::MissingIssuer {
                subject: subject_of(current),
                issuer: issuer_name,
            });
        };
        used.insert(next);
        path.push(next);
    }
}

/// Whether a certificate is some kind of proxy: it has a ProxyCertInfo (RFC or draft, critical
/// or not), or it has the shape of a legacy proxy.
fn looks_like_proxy(cert: &X509Certificate<'_>) -> bool {
    cert.extensions().iter().any(|e| {
        let oid = e.oid.to_id_string();
        oid == OID_PCI_RFC || oid == OID_PCI_DRAFT
    }) || is_legacy_shape(cert)
}

/// Subject = issuer + `CN=proxy` or `CN=limited proxy`, without any ProxyCertInfo.
fn is_legacy_shape(cert: &X509Certificate<'_>) -> bool {
    let subject = dn::rdns(cert.subject());
    let issuer = dn::rdns(cert.issuer());
    match subject.split_last() {
        Some((last, base)) => {
            base == issuer.as_slice()
                && matches!(last.as_slice(), [(oid, value)]
                    if oid == OID_CN && (value == "proxy" || value == "limited proxy"))
        }
        None => false,
    }
}

/// Refuses legacy and draft proxies.
fn generation(cert: &X509Certificate<'_>) -> Result<(), ChainError> {
    let has = |oid: &str| {
        cert.extensions()
            .iter()
            .any(|e| e.oid.to_id_string() == oid)
    };
    if has(OID_PCI_DRAFT) {
        return Err(ChainError::DraftProxy {
            subject: subject_of(cert),
        });
    }
    if !has(OID_PCI_RFC) {
        return Err(ChainError::LegacyProxy {
            subject: subject_of(cert),
        });
    }
    Ok(())
}

struct Checker<'c> {
    cas: &'c CaDir,
    opts: &'c VerifyOptions,
}

/// What a certificate is, for messages about its validity.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Role {
    EndEntity,
    Proxy,
    Ca,
}

impl Checker<'_> {
    /// The EEC (or a VOMS server's certificate) up to a trusted, self-signed CA.
    pub(crate) fn end_entity(
        &self,
        eec: &X509Certificate<'_>,
        warnings: &mut Vec<String>,
    ) -> Result<(), ChainError> {
        self.validity(eec, Role::EndEntity)?;
        self.key_size(eec)?;
        let exts = extension_oids(eec)?;
        critical_allowed(eec, &exts, EEC_CRITICAL_OK)?;
        let mut current = eec.clone();
        for intermediates in 0..MAX_CA_DEPTH as u32 {
            let ca_der = self.find_issuer(&current)?;
            let (_, ca) = X509Certificate::from_der(ca_der).map_err(|e| ChainError::NotACa {
                subject: dn::display_name(current.issuer()),
                dir: self.dir(),
                reason: e.to_string(),
            })?;
            self.ca(&ca, intermediates)?;
            self.revocation(&current, &ca, warnings)?;
            if dn::rdns(ca.subject()) == dn::rdns(ca.issuer()) {
                // A self-signed CA from the trusted directory: the anchor.
                return Ok(());
            }
            current = ca;
        }
        Err(ChainError::CaPathLen {
            subject: subject_of(&current),
            max: MAX_CA_DEPTH as u32,
        })
    }

    /// The trusted CA certificate whose key signed `cert`.
    fn find_issuer(&self, cert: &X509Certificate<'_>) -> Result<&[u8], ChainError> {
        let issuer = dn::display_name(cert.issuer());
        let mut last_error = None;
        for ca in self.cas.by_subject(&issuer) {
            let Ok((_, parsed)) = X509Certificate::from_der(&ca.der) else {
                continue;
            };
            match check_signature(cert, &parsed) {
                Ok(()) => return Ok(&ca.der),
                Err(e) => last_error = Some(e),
            }
        }
        Err(last_error.unwrap_or_else(|| ChainError::UnknownCa {
            subject: subject_of(cert),
            issuer,
            dir: self.dir(),
        }))
    }

    fn ca(&self, ca: &X509Certificate<'_>, intermediates: u32) -> Result<(), ChainError> {
        let not_a_ca = |reason: &str| ChainError::NotACa {
            subject: subject_of(ca),
            dir: self.dir(),
            reason: reason.to_owned(),
        };
        let exts = extension_oids(ca)?;
        critical_allowed(ca, &exts, CA_CRITICAL_OK)?;
        match basic_constraints(ca) {
            Some((true, path_len)) => {
                if let Some(max) = path_len {
                    if intermediates > max {
                        return Err(ChainError::CaPathLen {
                            subject: subject_of(ca),
                            max,
                        });
                    }
                }
            }
            _ => return Err(not_a_ca("no basicConstraints cA=TRUE")),
        }
        if let Some(ku) = key_usage(ca) {
            if !ku.key_cert_sign() {
                return Err(not_a_ca("its key usage lacks keyCertSign"));
            }
        }
        self.validity(ca, Role::Ca)?;
        self.key_size(ca)
    }

    /// Checks `cert` against the CRLs of its issuer `ca`, if the directory has any.
    fn revocation(
        &self,
        cert: &X509Certificate<'_>,
        ca: &X509Certificate<'_>,
        warnings: &mut Vec<String>,
    ) -> Result<(), ChainError> {
        let ca_name = subject_of(ca);
        for der in self.cas.crls_of(&ca_name) {
            let Ok((_, crl)) = CertificateRevocationList::from_der(der) else {
                continue;
            };
            let alg = crl.signature_algorithm.algorithm.to_id_string();
            if sig::verify(
                ca.public_key(),
                &alg,
                &crl.signature_value.data,
                crl.tbs_cert_list.as_ref(),
            )
            .is_err()
            {
                return Err(ChainError::CrlBadSignature {
                    ca: ca_name,
                    dir: self.dir(),
                });
            }
            if let Some(next_update) = crl.next_update() {
                let next_update = to_utc(next_update);
                if next_update + self.skew() < self.opts.now {
                    match self.opts.crl_policy {
                        CrlPolicy::Refuse => {
                            return Err(ChainError::CrlExpired {
                                ca: ca_name,
                                dir: self.dir(),
                                at: when(next_update),
                            })
                        }
                        CrlPolicy::Warn => warnings.push(format!(
                            "the CRL of CA {ca_name} in {} is out of date (next update was due {}): run fetch-crl to update it",
                            self.dir(),
                            when(next_update)
                        )),
                    }
                }
            }
            let serial = der::strip_leading_zeros(cert.raw_serial());
            if crl
                .iter_revoked_certificates()
                .any(|r| der::strip_leading_zeros(r.raw_serial()) == serial)
            {
                return Err(ChainError::Revoked {
                    subject: subject_of(cert),
                    serial: hex_of(serial),
                    ca: ca_name,
                });
            }
        }
        Ok(())
    }

    /// Every per-certificate rule of a proxy `proxy` issued by `issuer` (EEC or proxy).
    fn proxy(
        &self,
        proxy: &X509Certificate<'_>,
        issuer: &X509Certificate<'_>,
    ) -> Result<ProxyCertInfo, ChainError> {
        let subject = || subject_of(proxy);
        let exts = extension_oids(proxy)?;
        let pcis: Vec<_> = proxy
            .extensions()
            .iter()
            .filter(|e| e.oid.to_id_string() == OID_PCI_RFC)
            .collect();
        let pci_ext = match pcis.as_slice() {
            [one] => *one,
            [] => return Err(ChainError::LegacyProxy { subject: subject() }),
            _ => return Err(ChainError::DuplicatePci { subject: subject() }),
        };
        if !pci_ext.critical {
            return Err(ChainError::NonCriticalPci { subject: subject() });
        }
        let pci = decode_pci(pci_ext.value).map_err(|e| ChainError::BadPci {
            subject: subject(),
            reason: e.to_string(),
        })?;
        for (oid, name) in [(OID_SAN, "subjectAltName"), (OID_IAN, "issuerAltName")] {
            if exts.iter().any(|(o, _)| o == oid) {
                return Err(ChainError::ProxyAltName {
                    subject: subject(),
                    extension: name.to_owned(),
                });
            }
        }
        if matches!(basic_constraints(proxy), Some((true, _))) {
            return Err(ChainError::ProxyIsCa { subject: subject() });
        }
        critical_allowed(proxy, &exts, PROXY_CRITICAL_OK)?;
        name_rule(proxy, issuer)?;
        if is_ca(issuer) {
            return Err(ChainError::IssuerIsCa {
                subject: subject(),
                issuer: subject_of(issuer),
            });
        }
        if key_usage(issuer).is_some_and(|ku| !ku.digital_signature()) {
            return Err(ChainError::IssuerKeyUsage {
                subject: subject(),
                issuer: subject_of(issuer),
            });
        }
        self.key_size(proxy)?;
        check_signature(proxy, issuer)?;
        self.validity(proxy, Role::Proxy)?;
        Ok(pci)
    }

    pub(crate) fn validity(
        &self,
        cert: &X509Certificate<'_>,
        role: Role,
    ) -> Result<(), ChainError> {
        let not_before = to_utc(cert.validity().not_before);
        let not_after = to_utc(cert.validity().not_after);
        let now = self.opts.now;
        if now + self.skew() < not_before {
            return Err(ChainError::NotYetValid {
                subject: subject_of(cert),
                from: when(not_before),
            });
        }
        if now - self.skew() > not_after {
            let subject = subject_of(cert);
            let at = when(not_after);
            return Err(match role {
                Role::Proxy => ChainError::ProxyExpired { subject, at },
                Role::EndEntity => ChainError::CertificateExpired { subject, at },
                Role::Ca => ChainError::CaExpired {
                    subject,
                    at,
                    dir: self.dir(),
                },
            });
        }
        Ok(())
    }

    fn key_size(&self, cert: &X509Certificate<'_>) -> Result<(), ChainError> {
        match sig::rsa_bits(cert.public_key()) {
            Some(bits) if bits < self.opts.min_rsa_bits => Err(ChainError::WeakKey {
                subject: subject_of(cert),
                bits,
                min: self.opts.min_rsa_bits,
            }),
            _ => Ok(()),
        }
    }

    fn skew(&self) -> TimeDelta {
        TimeDelta::from_std(self.opts.clock_skew).unwrap_or(TimeDelta::zero())
    }

    fn dir(&self) -> String {
        self.cas.dir().display().to_string()
    }
}

/// Verifies a certificate (a VOMS server's) up to a trusted CA, as for an EEC.
pub(crate) fn verify_end_entity(
    cert: &X509Certificate<'_>,
    cas: &CaDir,
    opts: &VerifyOptions,
    warnings: &mut Vec<String>,
) -> Result<(), ChainError> {
    Checker { cas, opts }.end_entity(cert, warnings)
}

/// RFC 3820 §3.4: the proxy's subject is the issuer's subject plus one single-valued CN RDN.
fn name_rule(proxy: &X509Certificate<'_>, issuer: &X509Certificate<'_>) -> Result<(), ChainError> {
    let fail = |reason: &str| ChainError::ProxySubject {
        subject: subject_of(proxy),
        issuer: subject_of(issuer),
        reason: reason.to_owned(),
    };
    let issuer_subject: Rdns = dn::rdns(issuer.subject());
    if issuer_subject.is_empty() {
        return Err(fail("the issuer's subject is empty"));
    }
    if dn::rdns(proxy.issuer()) != issuer_subject {
        return Err(fail("its issuer name is not its issuer's subject"));
    }
    let subject = dn::rdns(proxy.subject());
    let Some((last, base)) = subject.split_last() else {
        return Err(fail("its subject is empty"));
    };
    if subject.len() != issuer_subject.len() + 1 {
        return Err(fail(&format!(
            "it has {} RDNs more than its issuer, not one",
            subject.len() as i64 - issuer_subject.len() as i64
        )));
    }
    if base != issuer_subject.as_slice() {
        return Err(fail("its subject does not start with its issuer's subject"));
    }
    match last.as_slice() {
        [(oid, _)] if oid == OID_CN => Ok(()),
        [_] => Err(fail("the added RDN is not a CN")),
        _ => Err(fail("the added RDN has more than one attribute")),
    }
}

/// Checks `cert`'s signature with `issuer`'s key.
fn check_signature(
    cert: &X509Certificate<'_>,
    issuer: &X509Certificate<'_>,
) -> Result<(), ChainError> {
    let alg = cert.signature_algorithm.algorithm.to_id_string();
    if sig::is_sha1(&alg) {
        return Err(ChainError::Sha1Signature {
            subject: subject_of(cert),
        });
    }
    sig::verify(
        issuer.public_key(),
        &alg,
        &cert.signature_value.data,
        cert.tbs_certificate.as_ref(),
    )
    .map_err(|e| match e {
        SigError::Unsupported(oid) => ChainError::UnsupportedSignatureAlgorithm {
            subject: subject_of(cert),
            oid,
        },
        SigError::Invalid => ChainError::BadSignature {
            subject: subject_of(cert),
            issuer: subject_of(issuer),
        },
    })
}

/// The (OID, critical) of each extension, refusing duplicates except of ProxyCertInfo (which has
/// its own rule, checked by the caller).
fn extension_oids(cert: &X509Certificate<'_>) -> Result<Vec<(String, bool)>, ChainError> {
    let exts: Vec<(String, bool)> = cert
        .extensions()
        .iter()
        .map(|e| (e.oid.to_id_string(), e.critical))
        .collect();
    match duplicate(&exts) {
        Some(oid) if oid != OID_PCI_RFC => Err(ChainError::DuplicateExtension {
            subject: subject_of(cert),
            oid: oid.to_owned(),
        }),
        _ => Ok(exts),
    }
}

fn duplicate(exts: &[(String, bool)]) -> Option<&str> {
    let mut seen = HashSet::new();
    exts.iter()
        .map(|(oid, _)| oid.as_str())
        .find(|oid| !seen.insert(*oid))
}

fn critical_allowed(
    cert: &X509Certificate<'_>,
    exts: &[(String, bool)],
    allowed: &[&str],
) -> Result<(), ChainError> {
    match exts
        .iter()
        .find(|(oid, critical)| *critical && !allowed.contains(&oid.as_str()))
    {
        Some((oid, _)) => Err(ChainError::UnknownCriticalExtension {
            subject: subject_of(cert),
            oid: oid.clone(),
        }),
        None => Ok(()),
    }
}

/// basicConstraints as (cA, pathLenConstraint), if present and readable.
fn basic_constraints(cert: &X509Certificate<'_>) -> Option<(bool, Option<u32>)> {
    cert.extensions()
        .iter()
        .find(|e| e.oid.to_id_string() == OID_BASIC_CONSTRAINTS)
        .map(|e| match e.parsed_extension() {
            ParsedExtension::BasicConstraints(bc) => (bc.ca, bc.path_len_constraint),
            // An unreadable basicConstraints is treated as claiming CA: refused everywhere a CA
            // is not wanted.
            _ => (true, Some(0)),
        })
}

fn is_ca(cert: &X509Certificate<'_>) -> bool {
    matches!(basic_constraints(cert), Some((true, _)))
}

fn key_usage(cert: &X509Certificate<'_>) -> Option<x509_parser::extensions::KeyUsage> {
    cert.extensions()
        .iter()
        .find(|e| e.oid.to_id_string() == OID_KEY_USAGE)
        .map(|e| match e.parsed_extension() {
            ParsedExtension::KeyUsage(ku) => *ku,
            // Unreadable: no usage at all.
            _ => x509_parser::extensions::KeyUsage { flags: 0 },
        })
}

pub(crate) fn subject_of(cert: &X509Certificate<'_>) -> String {
    dn::display_name(cert.subject())
}

pub(crate) fn to_utc(time: ASN1Time) -> DateTime<Utc> {
    DateTime::from_timestamp(time.timestamp(), 0).unwrap_or(DateTime::<Utc>::MIN_UTC)
}

fn not_after_of(cert: &X509Certificate<'_>) -> DateTime<Utc> {
    to_utc(cert.validity().not_after)
}

/// A time as messages show it: `2026-11-21 10:00 UTC`.
pub(crate) fn when(time: DateTime<Utc>) -> String {
    time.format("%Y-%m-%d %H:%M UTC").to_string()
}

fn hex_of(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02X}")).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rfc_pci_with_and_without_path_length() {
        // pathlen 2, inheritAll (research doc A.1.1).
        let pci = decode_pci(&[
            0x30, 0x0f, 0x02, 0x01, 0x02, 0x30, 0x0a, 0x06, 0x08, 0x2b, 0x06, 0x01, 0x05, 0x05,
            0x07, 0x15, 0x01,
        ])
        .unwrap();
        assert_eq!(pci.path_len, Some(2));
        assert_eq!(pci.language, OID_PPL_INHERIT_ALL);
        let pci = decode_pci(&[
            0x30, 0x0c, 0x30, 0x0a, 0x06, 0x08, 0x2b, 0x06, 0x01, 0x05, 0x05, 0x07, 0x15, 0x02,
        ])
        .unwrap();
        assert_eq!(pci.path_len, None);
        assert_eq!(pci.language, OID_PPL_INDEPENDENT);
    }

    #[test]
    fn draft_encoding_is_not_an_rfc_pci() {
        // The draft puts the policy first and the path length last, tagged [1].
        let draft = [
            0x30, 0x11, 0x30, 0x0a, 0x06, 0x08, 0x2b, 0x06, 0x01, 0x05, 0x05, 0x07, 0x15, 0x01,
            0xa1, 0x03, 0x02, 0x01, 0x02,
        ];
        assert!(decode_pci(&draft).is_err());
    }

    #[test]
    fn times_in_messages() {
        let t = DateTime::from_timestamp(1_795_255_200, 0).unwrap();
        assert_eq!(when(t), "2026-11-21 10:00 UTC");
    }
}
