//! VOMS attributes: the RFC 3281 attribute certificates (ACs) that `voms-proxy-init` puts into a
//! proxy (extension 1.3.6.1.4.1.8005.100.100.5), checked against the vomsdir
//! (`/etc/grid-security/vomsdir`): `<vo>/<host>.lsc` files naming the VOMS server's DN and its
//! CA's DN (the server certificate itself travels inside the AC and is checked against the CA
//! directory), or, old style, the VOMS server's PEM certificate in the vomsdir.
//!
//! An AC that is expired, untrusted, for another certificate or unreadable is dropped with a
//! warning, never an error: the user is still authenticated by the proxy, only without those
//! attributes. Time is a parameter.

use std::collections::HashMap;
use std::fmt;
use std::fs;
use std::path::{Path, PathBuf};
use std::str::FromStr;
use std::time::Duration;

use chrono::{DateTime, NaiveDateTime, TimeDelta, Utc};
use ongrid_core::Dn;
use x509_parser::prelude::{FromDer, X509Certificate};
use x509_parser::x509::X509Name;

use crate::cadir::CaDir;
use crate::chain::{self, VerifiedChain, VerifyOptions};
use crate::der::{
    self, DerError, Tlv, TAG_BIT_STRING, TAG_BOOLEAN, TAG_GENERALIZED_TIME, TAG_INTEGER,
    TAG_OCTET_STRING, TAG_OID, TAG_SEQUENCE, TAG_SET,
};
use crate::dn;
use crate::sig;

const OID_VOMS_ATTRIBUTES: &str = "1.3.6.1.4.1.8005.100.100.4";
const OID_VOMS_CERTSEQ: &str = "1.3.6.1.4.1.8005.100.100.10";
const OID_VOMS_GENERIC_ATTRIBUTES: &str = "1.3.6.1.4.1.8005.100.100.11";
const OID_NO_REV_AVAIL: &str = "2.5.29.56";
const OID_AKI: &str = "2.5.29.35";
const OID_AC_TARGETING: &str = "2.5.29.55";
/// VOMS tolerates 5 minutes of clock skew on AC validity.
const AC_SKEW: TimeDelta = TimeDelta::minutes(5);

/// Why the vomsdir could not be loaded.
#[derive(Debug, thiserror::Error)]
pub enum VomsDirError {
    #[error("cannot read the vomsdir {dir}: {source}: check the path (usually /etc/grid-security/vomsdir)")]
    Read {
        dir: PathBuf,
        #[source]
        source: std::io::Error,
    },
}

/// The trusted VOMS servers: LSC files per VO, and old-style server certificates.
#[derive(Debug, Clone, Default)]
pub struct VomsDir {
    dir: PathBuf,
    /// VO → LSC files of that VO, each (host, chains of DNs).
    lsc: HashMap<String, Vec<Lsc>>,
    /// Old-style VOMS server certificates (DER).
    certs: Vec<Vec<u8>>,
    warnings: Vec<String>,
}

#[derive(Debug, Clone)]
struct Lsc {
    host: String,
    /// Each chain: server DN, then its CA's DN (and further CAs).
    chains: Vec<Vec<String>>,
}

impl VomsDir {
    /// Reads `dir/<vo>/*.lsc` and old-style PEM certificates in `dir` and `dir/<vo>/`.
    pub fn load(dir: &Path) -> Result<VomsDir, VomsDirError> {
        let read_error = |source| VomsDirError::Read {
            dir: dir.to_owned(),
            source,
        };
        let mut vomsdir = VomsDir {
            dir: dir.to_owned(),
            ..VomsDir::default()
        };
        let mut entries: Vec<PathBuf> = fs::read_dir(dir)
            .map_err(read_error)?
            .filter_map(|e| e.ok().map(|e| e.path()))
            .collect();
        entries.sort();
        for path in entries {
            if path.is_dir() {
                let Some(vo) = path.file_name().and_then(|n| n.to_str()) else {
                    continue;
                };
                let mut files: Vec<PathBuf> = match fs::read_dir(&path) {
                    Ok(read) => read.filter_map(|e| e.ok().map(|e| e.path())).collect(),
                    Err(e) => {
                        vomsdir
                            .warnings
                            .push(format!("cannot read {}: {e}", path.display()));
                        continue;
                    }
                };
                files.sort();
                for file in files {
                    vomsdir.load_file(Some(vo), &file);
                }
            } else {
                vomsdir.load_file(None, &path);
            }
        }
        Ok(vomsdir)
    }

    fn load_file(&mut self, vo: Option<&str>, path: &Path) {
        let text = match fs::read(path) {
            Ok(bytes) => bytes,
            Err(e) => {
                self.warnings
                    .push(format!("cannot read {}: {e}", path.display()));
                return;
            }
        };
        let is_lsc = path.extension().is_some_and(|e| e == "lsc");
        match (vo, is_lsc) {
            (Some(vo), true) => {
                let host = path
                    .file_stem()
                    .and_then(|s| s.to_str())
                    .unwrap_or_default()
                    .to_owned();
                let chains = parse_lsc(&String::from_utf8_lossy(&text));
                if chains.iter().any(|c| c.len() >= 2) {
                    self.lsc
                        .entry(vo.to_owned())
                        .or_default()
                        .push(Lsc { host, chains });
                } else {
                    self.warnings.push(format!(
                        "{} does not hold a server DN and a CA DN: write the VOMS server's DN on the first line and its CA's DN on the second",
                        path.display()
                    ));
                }
            }
            _ => {
                let mut rest = text.as_slice();
                while let Ok(Some((item, next))) = rustls_pemfile::read_one_from_slice(rest) {
                    rest = next;
                    if let rustls_pemfile::Item::X509Certificate(der) = item {
                        self.certs.push(der.as_ref().to_vec());
                    }
                }
            }
        }
    }

    /// The directory this was loaded from.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// Files that were skipped, one sentence each.
    pub fn warnings(&self) -> &[String] {
        &self.warnings
    }
}

/// LSC text → chains of DNs; chains are separated by lines starting with `-`.
fn parse_lsc(text: &str) -> Vec<Vec<String>> {
    let mut chains = vec![Vec::new()];
    for line in text.lines().map(str::trim) {
        if line.is_empty() || line.starts_with('#') {
            continue;
        }
        if line.starts_with('-') {
            chains.push(Vec::new());
        } else if let Some(chain) = chains.last_mut() {
            chain.push(line.to_owned());
        }
    }
    chains.retain(|c| !c.is_empty());
    chains
}

/// The attributes of one VO, from one trusted, valid AC.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct VomsAttributes {
    pub vo: String,
    /// In the AC's order: the first is the primary FQAN.
    pub fqans: Vec<Fqan>,
    /// The VOMS server's DN.
    pub issuer: Dn,
    pub not_before: DateTime<Utc>,
    pub not_after: DateTime<Utc>,
    /// `host:port` of the VOMS server, from the AC's policy authority.
    pub uri: String,
}

/// The VOMS attributes of a verified chain, one per VO (the AC nearest the leaf wins), and
/// warnings for every AC that was dropped.
pub fn attributes(
    chain: &VerifiedChain,
    cas: &CaDir,
    vomsdir: &VomsDir,
    now: DateTime<Utc>,
) -> (Vec<VomsAttributes>, Vec<String>) {
    let mut found: Vec<VomsAttributes> = Vec::new();
    let mut warnings = Vec::new();
    for value in &chain.voms_der {
        let acs = match parse_ac_sequence(value) {
            Ok(acs) => acs,
            Err(e) => {
                warnings.push(format!(
                    "a VOMS extension of the proxy cannot be read ({e}): its attributes are ignored; run voms-proxy-init again"
                ));
                continue;
            }
        };
        for ac in acs {
            match check(&ac, chain, cas, vomsdir, now) {
                Ok(attributes) => {
                    if !found.iter().any(|f| f.vo == attributes.vo) {
                        found.push(attributes);
                    }
                }
                Err(warning) => warnings.push(warning),
            }
        }
    }
    (found, warnings)
}

/// Parses the value of the VOMS AC extension into its ACs (for tests and fuzzing).
pub fn parse_ac_extension(value: &[u8]) -> Result<Vec<ParsedAc>, DerError> {
    let acs = parse_ac_sequence(value)?;
    Ok(acs
        .iter()
        .map(|ac| ParsedAc {
            vo: ac.vo.clone(),
            uri: ac.uri.clone(),
            issuer: ac.issuer.clone(),
            fqans: ac.fqans.clone(),
            not_before: ac.not_before,
            not_after: ac.not_after,
        })
        .collect())
}

/// What an AC says, before any trust decision.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ParsedAc {
    pub vo: Option<String>,
    pub uri: Option<String>,
    pub issuer: String,
    pub fqans: Vec<String>,
    pub not_before: DateTime<Utc>,
    pub not_after: DateTime<Utc>,
}

/// One AC, parsed.
#[derive(Debug, Clone)]
struct Ac<'a> {
    info_raw: &'a [u8],
    signature_alg: String,
    signature: &'a [u8],
    holder_issuer: Option<String>,
    holder_serial: Option<&'a [u8]>,
    issuer: String,
    not_before: DateTime<Utc>,
    not_after: DateTime<Utc>,
    vo: Option<String>,
    uri: Option<String>,
    fqans: Vec<String>,
    certs: Vec<&'a [u8]>,
    unknown_critical: Option<String>,
    targeted: bool,
}

/// The ACs in the extension value, wherever they sit in its (VOMS-version dependent) nesting.
fn parse_ac_sequence(value: &[u8]) -> Result<Vec<Ac<'_>>, DerError> {
    let outer = der::single(value, TAG_SEQUENCE)?;
    let mut acs = Vec::new();
    collect_acs(outer, 0, &mut acs)?;
    if acs.is_empty() {
        return Err(DerError::Malformed("no attribute certificate"));
    }
    Ok(acs)
}

fn collect_acs<'a>(tlv: Tlv<'a>, depth: usize, out: &mut Vec<Ac<'a>>) -> Result<(), DerError> {
    if depth > 3 || tlv.tag != TAG_SEQUENCE {
        return Err(DerError::Malformed("attribute certificate sequence"));
    }
    if looks_like_ac(&tlv) {
        out.push(parse_ac(tlv)?);
        return Ok(());
    }
    let mut reader = tlv.reader();
    while !reader.is_empty() {
        collect_acs(reader.read()?, depth + 1, out)?;
    }
    Ok(())
}

/// SEQUENCE { SEQUENCE { INTEGER, ... }, SEQUENCE, BIT STRING }.
fn looks_like_ac(tlv: &Tlv<'_>) -> bool {
    let mut reader = tlv.reader();
    let (Ok(info), Ok(alg), Ok(sig)) = (reader.read(), reader.read(), reader.read()) else {
        return false;
    };
    reader.is_empty()
        && info.tag == TAG_SEQUENCE
        && info.reader().peek_tag() == Some(TAG_INTEGER)
        && alg.tag == TAG_SEQUENCE
        && sig.tag == TAG_BIT_STRING
}

fn parse_ac(tlv: Tlv<'_>) -> Result<Ac<'_>, DerError> {
    let mut reader = tlv.reader();
    let info = reader.expect(TAG_SEQUENCE)?;
    let alg = reader.expect(TAG_SEQUENCE)?;
    let signature = reader.expect(TAG_BIT_STRING)?;
    reader.finish()?;
    let signature_alg = der::oid_string(alg.reader().expect(TAG_OID)?.value)?;
    let signature = match signature.value.split_first() {
        Some((0, bits)) => bits,
        _ => return Err(DerError::Malformed("signature bit string")),
    };

    let mut info_reader = info.reader();
    let version = info_reader.expect(TAG_INTEGER)?;
    if der::small_uint(version.value)? != 1 {
        return Err(DerError::Malformed(
            "attribute certificate version is not v2",
        ));
    }
    // Holder ::= SEQUENCE { baseCertificateID [0] IssuerSerial OPTIONAL, ... }
    let holder = info_reader.expect(TAG_SEQUENCE)?;
    let mut holder_issuer = None;
    let mut holder_serial = None;
    if let Some(base) = holder.reader().optional(0xa0)? {
        let mut base_reader = base.reader();
        holder_issuer = directory_name(base_reader.expect(TAG_SEQUENCE)?)?;
        holder_serial = Some(base_reader.expect(TAG_INTEGER)?.value);
    }
    // AttCertIssuer: v2Form [0] { issuerName GeneralNames, ... } or v1Form GeneralNames.
    let issuer_tlv = info_reader.read()?;
    let issuer_names = match issuer_tlv.tag {
        0xa0 => issuer_tlv.reader().expect(TAG_SEQUENCE)?,
        TAG_SEQUENCE => issuer_tlv,
        found => {
            return Err(DerError::UnexpectedTag {
                expected: 0xa0,
                found,
            })
        }
    };
    let issuer = directory_name(issuer_names)?.ok_or(DerError::Malformed("AC issuer name"))?;
    info_reader.expect(TAG_SEQUENCE)?; // signature algorithm, repeated
    info_reader.expect(TAG_INTEGER)?; // serial
    let validity = info_reader.expect(TAG_SEQUENCE)?;
    let mut validity_reader = validity.reader();
    let not_before = generalized_time(validity_reader.expect(TAG_GENERALIZED_TIME)?.value)?;
    let not_after = generalized_time(validity_reader.expect(TAG_GENERALIZED_TIME)?.value)?;
    validity_reader.finish()?;

    let mut ac = Ac {
        info_raw: info.raw,
        signature_alg,
        signature,
        holder_issuer,
        holder_serial,
        issuer,
        not_before,
        not_after,
        vo: None,
        uri: None,
        fqans: Vec::new(),
        certs: Vec::new(),
        unknown_critical: None,
        targeted: false,
    };
    let attributes = info_reader.expect(TAG_SEQUENCE)?;
    let mut attributes_reader = attributes.reader();
    while !attributes_reader.is_empty() {
        let attribute = attributes_reader.expect(TAG_SEQUENCE)?;
        let mut attribute_reader = attribute.reader();
        let oid = der::oid_string(attribute_reader.expect(TAG_OID)?.value)?;
        let values = attribute_reader.expect(TAG_SET)?;
        if oid == OID_VOMS_ATTRIBUTES {
            parse_ietf_attributes(values, &mut ac)?;
        }
    }
    info_reader.optional(TAG_BIT_STRING)?; // issuerUniqueID
    if let Some(extensions) = info_reader.optional(TAG_SEQUENCE)? {
        let mut extensions_reader = extensions.reader();
        while !extensions_reader.is_empty() {
            let extension = extensions_reader.expect(TAG_SEQUENCE)?;
            let mut extension_reader = extension.reader();
            let oid = der::oid_string(extension_reader.expect(TAG_OID)?.value)?;
            let critical = match extension_reader.optional(TAG_BOOLEAN)? {
                Some(flag) => flag.value.first().is_some_and(|b| *b != 0),
                None => false,
            };
            let value = extension_reader.expect(TAG_OCTET_STRING)?;
            match oid.as_str() {
                OID_VOMS_CERTSEQ => {
                    collect_certs(der::single(value.value, TAG_SEQUENCE)?, 0, &mut ac.certs)
                }
                OID_AC_TARGETING => ac.targeted = true,
                OID_VOMS_GENERIC_ATTRIBUTES | OID_NO_REV_AVAIL | OID_AKI => {}
                _ if critical => ac.unknown_critical = Some(oid),
                _ => {}
            }
        }
    }
    info_reader.finish()?;
    Ok(ac)
}

/// IetfAttrSyntax ::= SEQUENCE { policyAuthority [0] GeneralNames OPTIONAL,
/// values SEQUENCE OF (OCTET STRING | OID | UTF8String) }, one per SET element.
fn parse_ietf_attributes(values: Tlv<'_>, ac: &mut Ac<'_>) -> Result<(), DerError> {
    let mut set = values.reader();
    while !set.is_empty() {
        let syntax = set.expect(TAG_SEQUENCE)?;
        let mut reader = syntax.reader();
        if let Some(authority) = reader.optional(0xa0)? {
            let mut names = authority.reader();
            while !names.is_empty() {
                let name = names.read()?;
                // uniformResourceIdentifier [6] IA5String: "<vo>://<host>:<port>"
                if name.tag == 0x86 {
                    let text = String::from_utf8_lossy(name.value);
                    if let Some((vo, uri)) = text.split_once("://") {
                        ac.vo = Some(vo.to_owned());
                        ac.uri = Some(uri.to_owned());
                    }
                }
            }
        }
        let list = reader.expect(TAG_SEQUENCE)?;
        let mut list_reader = list.reader();
        while !list_reader.is_empty() {
            let value = list_reader.read()?;
            if value.tag == TAG_OCTET_STRING || value.tag == 0x0c {
                ac.fqans
                    .push(String::from_utf8_lossy(value.value).into_owned());
            }
        }
    }
    Ok(())
}

/// The certificates in the certseq extension, wherever they sit in its nesting.
fn collect_certs<'a>(tlv: Tlv<'a>, depth: usize, out: &mut Vec<&'a [u8]>) {
    if depth > 3 || tlv.tag != TAG_SEQUENCE {
        return;
    }
    if matches!(X509Certificate::from_der(tlv.raw), Ok((rest, _)) if rest.is_empty()) {
        out.push(tlv.raw);
        return;
    }
    let mut reader = tlv.reader();
    while let Ok(child) = reader.read() {
        collect_certs(child, depth + 1, out);
    }
}

/// The first directoryName in GeneralNames (a SEQUENCE), in slash form.
fn directory_name(names: Tlv<'_>) -> Result<Option<String>, DerError> {
    let mut reader = names.reader();
    while !reader.is_empty() {
        let name = reader.read()?;
        if name.tag == 0xa4 {
            let inner = der::single(name.value, TAG_SEQUENCE)?;
            let (_, parsed) =
                X509Name::from_der(inner.raw).map_err(|_| DerError::Malformed("directory name"))?;
            return Ok(Some(dn::display_name(&parsed)));
        }
    }
    Ok(None)
}

/// `YYYYMMDDHHMMSSZ`.
fn generalized_time(bytes: &[u8]) -> Result<DateTime<Utc>, DerError> {
    let text = std::str::from_utf8(bytes).map_err(|_| DerError::Malformed("time"))?;
    NaiveDateTime::parse_from_str(text, "%Y%m%d%H%M%SZ")
        .map(|t| t.and_utc())
        .map_err(|_| DerError::Malformed("time"))
}

/// Every trust rule for one AC; `Err` is the warning that says why it is dropped.
fn check(
    ac: &Ac<'_>,
    chain: &VerifiedChain,
    cas: &CaDir,
    vomsdir: &VomsDir,
    now: DateTime<Utc>,
) -> Result<VomsAttributes, String> {
    let issuer = &ac.issuer;
    let (Some(vo), Some(uri)) = (ac.vo.clone(), ac.uri.clone()) else {
        return Err(format!(
            "a VOMS attribute certificate from {issuer} names no VO: its attributes are ignored"
        ));
    };
    let dropped = |why: String| format!("VOMS attributes of VO {vo} ignored: {why}");
    let holder_ok = ac.holder_serial.map(der::strip_leading_zeros)
        == Some(chain.end_entity_serial.as_slice())
        && ac.holder_issuer.as_deref().is_some_and(|h| {
            h == chain.end_entity_subject.as_str() || h == chain.end_entity_issuer.as_str()
        });
    if !holder_ok {
        return Err(dropped(format!(
            "they were issued for another certificate ({}), not {}; run voms-proxy-init again",
            ac.holder_issuer.as_deref().unwrap_or("no holder"),
            chain.end_entity_subject
        )));
    }
    if now > ac.not_after + AC_SKEW {
        return Err(dropped(format!(
            "they expired at {}: run voms-proxy-init again",
            chain::when(ac.not_after)
        )));
    }
    if now + AC_SKEW < ac.not_before {
        return Err(dropped(format!(
            "they are not valid before {}: check the clocks",
            chain::when(ac.not_before)
        )));
    }
    if let Some(oid) = &ac.unknown_critical {
        return Err(dropped(format!(
            "the attribute certificate has the unknown critical extension {oid}"
        )));
    }
    if ac.targeted {
        return Err(dropped(
            "the attribute certificate is targeted at specific services: run voms-proxy-init without -target".to_owned(),
        ));
    }
    let server_der = trusted_server(ac, &vo, cas, vomsdir, now).map_err(&dropped)?;
    let (_, server) = X509Certificate::from_der(&server_der).map_err(|e| {
        dropped(format!(
            "the VOMS server certificate is not valid X.509: {e}"
        ))
    })?;
    if sig::verify(
        server.public_key(),
        &ac.signature_alg,
        ac.signature,
        ac.info_raw,
    )
    .is_err()
    {
        return Err(dropped(format!(
            "the attribute certificate's signature does not verify with the key of {issuer}"
        )));
    }
    let mut fqans = Vec::with_capacity(ac.fqans.len());
    for text in &ac.fqans {
        let fqan = Fqan::parse(text).map_err(|e| dropped(e.to_string()))?;
        if fqan.vo() != vo {
            return Err(dropped(format!(
                "the FQAN {fqan} is not in VO {vo}: the VOMS server of {vo} may only assert its own groups"
            )));
        }
        fqans.push(fqan);
    }
    let issuer = Dn::parse(issuer).map_err(|e| dropped(e.to_string()))?;
    Ok(VomsAttributes {
        vo,
        fqans,
        issuer,
        not_before: ac.not_before,
        not_after: ac.not_after,
        uri,
    })
}

/// The DER certificate of the AC's VOMS server, if the vomsdir trusts it for `vo` and it chains
/// to a trusted CA; otherwise why not.
fn trusted_server(
    ac: &Ac<'_>,
    vo: &str,
    cas: &CaDir,
    vomsdir: &VomsDir,
    now: DateTime<Utc>,
) -> Result<Vec<u8>, String> {
    let opts = VerifyOptions {
        clock_skew: Duration::from_secs(300),
        ..VerifyOptions::at(now)
    };
    let host = ac
        .uri
        .as_deref()
        .map(|u| u.rsplit_once(':').map_or(u, |(h, _)| h))
        .unwrap_or_default();
    let lsc_files = vomsdir.lsc.get(vo).map(Vec::as_slice).unwrap_or(&[]);
    let server = ac
        .certs
        .first()
        .and_then(|der| X509Certificate::from_der(der).ok())
        .map(|(_, c)| c);
    if let (Some(server), false) = (&server, lsc_files.is_empty()) {
        let mut actual = vec![chain::subject_of(server), dn::display_name(server.issuer())];
        for der in ac.certs.iter().skip(1) {
            if let Ok((_, c)) = X509Certificate::from_der(der) {
                actual.push(dn::display_name(c.issuer()));
            }
        }
        // The LSC named after the server's host first, then the VO's others.
        let mut ordered: Vec<&Lsc> = lsc_files.iter().filter(|l| l.host == host).collect();
        ordered.extend(lsc_files.iter().filter(|l| l.host != host));
        let matches = ordered.iter().flat_map(|l| &l.chains).any(|lsc_chain| {
            let n = lsc_chain.len().min(actual.len());
            n >= 2 && lsc_chain[..n] == actual[..n]
        });
        if !matches {
            return Err(format!(
                "the VOMS server {} is not listed for VO {vo} in {}: add {}/{vo}/{host}.lsc with its DN and its CA's DN",
                actual[0],
                vomsdir.dir.display(),
                vomsdir.dir.display()
            ));
        }
        if actual[0] != ac.issuer {
            return Err(format!(
                "the attribute certificate names {} as issuer but carries the certificate of {}",
                ac.issuer, actual[0]
            ));
        }
        let mut warnings = Vec::new();
        chain::verify_end_entity(server, cas, &opts, &mut warnings)
            .map_err(|e| format!("the VOMS server certificate is not trusted: {e}"))?;
        return Ok(ac.certs[0].to_vec());
    }
    // Old style: the server's certificate in the vomsdir.
    let mut last_error = None;
    for der in &vomsdir.certs {
        let Ok((_, cert)) = X509Certificate::from_der(der) else {
            continue;
        };
        if chain::subject_of(&cert) != ac.issuer {
            continue;
        }
        let mut warnings = Vec::new();
        match chain::verify_end_entity(&cert, cas, &opts, &mut warnings) {
            Ok(()) => return Ok(der.clone()),
            Err(e) => last_error = Some(format!("the VOMS server certificate is not trusted: {e}")),
        }
    }
    Err(last_error.unwrap_or_else(|| {
        format!(
            "the VOMS server {} is not trusted for VO {vo}: add {}/{vo}/{host}.lsc with its DN and its CA's DN",
            ac.issuer,
            vomsdir.dir.display()
        )
    }))
}

/// Why an FQAN could not be parsed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum FqanError {
    #[error("FQAN {0:?} must start with /<vo>, like /myvo/group/Role=admin")]
    NoVo(String),
    #[error("FQAN {0:?} has an empty group or a group with '=': write /<vo>[/<group>...][/Role=<role>][/Capability=<capability>]")]
    BadGroup(String),
    #[error("FQAN {0:?} has Role/Capability out of place or empty: write /<vo>[/<group>...][/Role=<role>][/Capability=<capability>]")]
    BadQualifier(String),
}

/// A VOMS Fully Qualified Attribute Name: `/<vo>[/<group>...][/Role=<role>][/Capability=<c>]`.
/// `Role=NULL` and `Capability=NULL` mean none and are dropped.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Fqan {
    /// `/vo/group/subgroup`.
    group: String,
    role: Option<String>,
    capability: Option<String>,
}

impl Fqan {
    pub fn parse(text: &str) -> Result<Fqan, FqanError> {
        let rest = text
            .strip_prefix('/')
            .ok_or_else(|| FqanError::NoVo(text.to_owned()))?;
        let mut group = String::new();
        let mut role = None;
        let mut capability = None;
        for part in rest.split('/') {
            if let Some(value) = part.strip_prefix("Role=") {
                if role.is_some() || capability.is_some() || group.is_empty() || value.is_empty() {
                    return Err(FqanError::BadQualifier(text.to_owned()));
                }
                role = Some(value.to_owned());
            } else if let Some(value) = part.strip_prefix("Capability=") {
                if capability.is_some() || group.is_empty() || value.is_empty() {
                    return Err(FqanError::BadQualifier(text.to_owned()));
                }
                capability = Some(value.to_owned());
            } else {
                if part.is_empty() || part.contains('=') {
                    return Err(if group.is_empty() && part.is_empty() {
                        FqanError::NoVo(text.to_owned())
                    } else {
                        FqanError::BadGroup(text.to_owned())
                    });
                }
                if role.is_some() || capability.is_some() {
                    return Err(FqanError::BadQualifier(text.to_owned()));
                }
                group.push('/');
                group.push_str(part);
            }
        }
        let not_null = |v: Option<String>| v.filter(|v| v != "NULL");
        Ok(Fqan {
            group,
            role: not_null(role),
            capability: not_null(capability),
        })
    }

    /// The VO: the first group component.
    pub fn vo(&self) -> &str {
        self.group[1..].split('/').next().unwrap_or_default()
    }

    /// The group path, `/vo/group/subgroup`.
    pub fn group(&self) -> &str {
        &self.group
    }

    pub fn role(&self) -> Option<&str> {
        self.role.as_deref()
    }

    pub fn capability(&self) -> Option<&str> {
        self.capability.as_deref()
    }

    /// Whether this FQAN satisfies a policy `pattern` like `/myvo` (membership of exactly that
    /// group, any role) or `/myvo/Role=admin` (that role in that group). Subgroups do not match
    /// their parent's pattern: VOMS lists the parent group's FQAN separately.
    pub fn matches(&self, pattern: &Fqan) -> bool {
        self.group == pattern.group
            && pattern
                .role
                .as_ref()
                .is_none_or(|r| self.role.as_ref() == Some(r))
            && pattern
                .capability
                .as_ref()
                .is_none_or(|c| self.capability.as_ref() == Some(c))
    }
}

impl fmt::Display for Fqan {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.group)?;
        if let Some(role) = &self.role {
            write!(f, "/Role={role}")?;
        }
        if let Some(capability) = &self.capability {
            write!(f, "/Capability={capability}")?;
        }
        Ok(())
    }
}

impl FromStr for Fqan {
    type Err = FqanError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Fqan::parse(s)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn fqans_with_null_role_and_capability() {
        let fqan = Fqan::parse("/testvo/Role=NULL/Capability=NULL").unwrap();
        assert_eq!(fqan.vo(), "testvo");
        assert_eq!(fqan.group(), "/testvo");
        assert_eq!(fqan.role(), None);
        assert_eq!(fqan.to_string(), "/testvo");
        let fqan = Fqan::parse("/testvo/prod/Role=production/Capability=NULL").unwrap();
        assert_eq!(fqan.group(), "/testvo/prod");
        assert_eq!(fqan.role(), Some("production"));
        assert_eq!(fqan.to_string(), "/testvo/prod/Role=production");
    }

    #[test]
    fn bad_fqans_are_refused() {
        for bad in [
            "",
            "testvo",
            "/",
            "//x",
            "/vo//g",
            "/Role=admin",
            "/vo/Role=",
            "/vo/Role=a/Role=b",
            "/vo/Capability=c/Role=r",
            "/vo/Role=a/group",
            "/vo/a=b",
        ] {
            assert!(Fqan::parse(bad).is_err(), "{bad:?} was accepted");
        }
    }

    #[test]
    fn policy_patterns() {
        let admin = Fqan::parse("/myvo/Role=admin/Capability=NULL").unwrap();
        let member = Fqan::parse("/myvo/Role=NULL").unwrap();
        let sub_admin = Fqan::parse("/myvo/sub/Role=admin").unwrap();
        let pattern_admin = Fqan::parse("/myvo/Role=admin").unwrap();
        let pattern_vo = Fqan::parse("/myvo").unwrap();
        assert!(admin.matches(&pattern_admin));
        assert!(admin.matches(&pattern_vo));
        assert!(member.matches(&pattern_vo));
        assert!(!member.matches(&pattern_admin));
        assert!(!sub_admin.matches(&pattern_admin));
        assert!(!Fqan::parse("/othervo/Role=admin")
            .unwrap()
            .matches(&pattern_admin));
    }

    #[test]
    fn lsc_chains() {
        let chains =
            parse_lsc("/DC=org/CN=voms\n/DC=org/CN=CA\n------ NEXT CHAIN ------\n/CN=a\n/CN=b\n\n");
        assert_eq!(
            chains,
            vec![
                vec!["/DC=org/CN=voms".to_owned(), "/DC=org/CN=CA".to_owned()],
                vec!["/CN=a".to_owned(), "/CN=b".to_owned()]
            ]
        );
    }

    proptest! {
        // Display then parse is the identity, and Display never shows NULL.
        #[test]
        fn fqan_round_trip(
            groups in proptest::collection::vec("[a-z0-9_.-]{1,8}", 1..4),
            role in proptest::option::of("[a-zA-Z0-9_-]{1,8}"),
            capability in proptest::option::of("[a-zA-Z0-9_-]{1,8}"),
        ) {
            let mut text = String::new();
            for g in &groups { text.push('/'); text.push_str(g); }
            if let Some(r) = &role { text.push_str("/Role="); text.push_str(r); }
            if let Some(c) = &capability { text.push_str("/Capability="); text.push_str(c); }
            let fqan = Fqan::parse(&text).unwrap();
            prop_assert_eq!(fqan.vo(), groups[0].as_str());
            let shown = fqan.to_string();
            prop_assert!(!shown.contains("=NULL"));
            prop_assert_eq!(Fqan::parse(&shown).unwrap(), fqan.clone());
            let group_pattern = Fqan::parse(&format!("/{}", groups.join("/"))).unwrap();
            prop_assert!(fqan.matches(&group_pattern));
        }

        #[test]
        fn fqan_parse_never_panics(text in ".{0,40}") {
            let _ = Fqan::parse(&text);
        }
    }
}
