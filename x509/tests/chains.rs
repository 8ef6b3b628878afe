//! Integration tests of ongrid-x509 against real grid tooling: credentials are made at run time
//! (once per test binary) with `scripts/gridca.sh`, `grid-proxy-init` and `voms-proxy-fake`;
//! chains that break one rule each are made with `openssl x509 -req` and extension files. Proxies
//! expire, so none is committed.

// Test helpers outside #[test] functions unwrap too: a failure there is a test failure.
#![allow(clippy::unwrap_used)]

use std::collections::HashMap;
use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{LazyLock, OnceLock};

use chrono::{DateTime, Duration, Utc};
use ongrid_x509::voms::{self, Fqan, VomsDir};
use ongrid_x509::{
    dn_of, read_pem_chain, verify_chain, CaDir, ChainError, CrlPolicy, ProxyKind, VerifiedChain,
    VerifyOptions,
};
use x509_parser::prelude::{FromDer, X509Certificate};

const BASE: &str = "/DC=org/DC=ongrid-test";
const VO: &str = "testvo";
const VOMS_HOST: &str = "voms.ongrid-test.org";
const ROGUE_HOST: &str = "rogue.ongrid-test.org";

struct Fixture {
    dir: PathBuf,
    /// Chains by name, leaf first, as the files hold them.
    chains: HashMap<String, Vec<Vec<u8>>>,
}

static FIXTURE: LazyLock<Fixture> = LazyLock::new(build_fixture);

fn fixture() -> &'static Fixture {
    &FIXTURE
}

impl Fixture {
    fn chain(&self, name: &str) -> Vec<Vec<u8>> {
        self.chains
            .get(name)
            .unwrap_or_else(|| panic!("no chain {name} in the fixture"))
            .clone()
    }

    fn main_cas(&self) -> CaDir {
        CaDir::load(&self.dir.join("main/certificates")).unwrap()
    }

    fn vomsdir(&self) -> VomsDir {
        VomsDir::load(&self.dir.join("main/vomsdir")).unwrap()
    }
}

fn opts() -> VerifyOptions {
    VerifyOptions::at(Utc::now())
}

fn verify(name: &str) -> Result<VerifiedChain, ChainError> {
    let f = fixture();
    verify_chain(&f.chain(name), &f.main_cas(), &opts())
}

fn verify_at(name: &str, now: DateTime<Utc>) -> Result<VerifiedChain, ChainError> {
    let f = fixture();
    verify_chain(&f.chain(name), &f.main_cas(), &VerifyOptions::at(now))
}

fn alice() -> String {
    format!("{BASE}/OU=People/CN=alice")
}

// ---------------------------------------------------------------------------------------------
// Building the fixture

fn run(cmd: &mut Command) -> String {
    let out = cmd
        .output()
        .unwrap_or_else(|e| panic!("cannot run {cmd:?}: {e} (is it installed? see .ci/run)"));
    assert!(
        out.status.success(),
        "{cmd:?} failed: {}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

fn gridca_script() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("scripts/gridca.sh")
}

/// The key all user, host and VOMS certificates share (key generation is the slow part).
static LEAF_KEY: OnceLock<PathBuf> = OnceLock::new();

fn gridca(args: &[&str]) -> String {
    let mut cmd = Command::new(gridca_script());
    cmd.args(args);
    if let Some(key) = LEAF_KEY.get() {
        cmd.env("GRIDCA_KEY", key);
    }
    run(&mut cmd)
}

fn openssl(args: &[&str]) -> String {
    run(Command::new("openssl").args(args))
}

fn genkey(path: &Path) {
    openssl(&[
        "genpkey",
        "-algorithm",
        "RSA",
        "-pkeyopt",
        "rsa_keygen_bits:2048",
        "-out",
        &path.display().to_string(),
    ]);
}

/// Removes fixture directories of test processes that are gone.
fn remove_stale(parent: &Path) {
    let Ok(entries) = std::fs::read_dir(parent) else {
        return;
    };
    for entry in entries.flatten() {
        let name = entry.file_name().to_string_lossy().into_owned();
        if let Some(pid) = name.strip_prefix("x509-fixture-") {
            if !Path::new("/proc").join(pid).exists() {
                let _ = std::fs::remove_dir_all(entry.path());
            }
        }
    }
}

/// Runs independent fixture steps on threads (most of the time is RSA key generation).
fn parallel(steps: Vec<Box<dyn FnOnce() + Send + '_>>) {
    std::thread::scope(|scope| {
        let handles: Vec<_> = steps.into_iter().map(|step| scope.spawn(step)).collect();
        for handle in handles {
            if let Err(panic) = handle.join() {
                std::panic::resume_unwind(panic);
            }
        }
    });
}

fn build_fixture() -> Fixture {
    let started = std::time::Instant::now();
    let parent = Path::new(env!("CARGO_TARGET_TMPDIR"));
    remove_stale(parent);
    let dir = parent.join(format!("x509-fixture-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let main = dir.join("main");
    let other = dir.join("other");
    let stale = dir.join("stale");
    let (m, o, st) = (
        main.display().to_string(),
        other.display().to_string(),
        stale.display().to_string(),
    );
    let d = |name: &str| dir.join(format!("{name}.pem")).display().to_string();
    let key = dir.join("proxykey.pem");
    let leaf_key = dir.join("leafkey.pem");

    // Stage 1: keys and CAs (each CA has its own key).
    parallel(vec![
        Box::new(|| genkey(&key)),
        Box::new(|| genkey(&leaf_key)),
        Box::new(|| {
            gridca(&["ca", &m]);
        }),
        Box::new(|| {
            gridca(&["ca", &o, "other test CA"]);
        }),
        Box::new(|| {
            gridca(&["ca", &st, "stale test CA"]);
        }),
    ]);
    LEAF_KEY.set(leaf_key.clone()).unwrap();

    // Stage 2: users and servers.
    for user in ["alice", "bob"] {
        gridca(&["user", &m, user]);
    }
    gridca(&["revoke", &m, "bob"]);
    gridca(&["voms", &m, VO, VOMS_HOST]);
    // A VOMS server with a certificate from the trusted CA, but listed for another VO only.
    gridca(&["voms", &m, "othervo", ROGUE_HOST]);
    run(Command::new(gridca_script())
        .args(["user", &m, "expired"])
        .env("GRIDCA_KEY", &leaf_key)
        .env("GRIDCA_STARTDATE", "20200101000000Z")
        .env("GRIDCA_ENDDATE", "20210101000000Z"));
    gridca(&["user", &o, "mallory"]);
    gridca(&["user", &st, "carol"]);
    gridca(&["crl", &st, "1"]);

    // Stage 3: proxies made by the real tools, independent lines in parallel.
    let proxy = |ca: &str, from: &str, out: &str, flags: &[&str]| {
        let mut args = vec!["proxy", ca, from, out];
        args.extend_from_slice(flags);
        gridca(&args);
    };
    let vomsproxy = |host: &str, out: &str, flags: &[&str]| {
        let mut args = vec!["vomsproxy", m.as_str(), "alice", VO, host, out];
        args.extend_from_slice(flags);
        gridca(&args);
    };
    parallel(vec![
        Box::new(|| {
            proxy(&m, "alice", &d("rfc"), &[]);
            proxy(&m, &d("rfc"), &d("rfc_2nd"), &[]);
            proxy(&m, "alice", &d("limited"), &["-limited"]);
            proxy(&m, &d("limited"), &d("from_limited"), &[]);
            broken_chains(&dir, &main, &key);
        }),
        Box::new(|| {
            proxy(&m, "alice", &d("independent"), &["-independent"]);
            proxy(&m, "alice", &d("short"), &["-valid", "0:1"]);
            proxy(&m, "alice", &d("legacy"), &["-old"]);
            proxy(&m, "alice", &d("draft"), &["-draft"]);
            proxy(&m, "alice", &d("pl1"), &["-path-length", "1"]);
            proxy(&m, &d("pl1"), &d("pl1_a"), &[]);
            proxy(&m, &d("pl1_a"), &d("pl1_b"), &[]);
        }),
        Box::new(|| {
            proxy(&m, "alice", &d("rsa1024"), &["-bits", "1024"]);
            proxy(&m, &d("rsa1024"), &d("below_1024"), &[]);
            // grid-proxy-init writes "infinite" for -path-length 0; voms-proxy-fake writes 0.
            vomsproxy(VOMS_HOST, &d("pl0"), &["-path-length", "0"]);
            proxy(&m, &d("pl0"), &d("pl0_child"), &[]);
            vomsproxy(
                VOMS_HOST,
                &d("voms"),
                &[
                    "-fqan",
                    "/testvo/Role=NULL/Capability=NULL",
                    "-fqan",
                    "/testvo/prod/Role=admin/Capability=NULL",
                ],
            );
            proxy(&m, &d("voms"), &d("voms_2nd"), &[]);
            vomsproxy(
                VOMS_HOST,
                &d("voms_expired_ac"),
                &["-pastac", "3:00", "-vomslife", "1"],
            );
            vomsproxy(ROGUE_HOST, &d("voms_untrusted"), &[]);
        }),
    ]);

    let mut chains = HashMap::new();
    for entry in std::fs::read_dir(&dir).unwrap().flatten() {
        let path = entry.path();
        if path.extension().is_some_and(|e| e == "pem") {
            let name = path.file_stem().unwrap().to_string_lossy().into_owned();
            // The key files hold no certificate.
            if let Ok((certs, _)) = read_pem_chain(&std::fs::read(&path).unwrap()) {
                chains.insert(name, certs);
            }
        }
    }
    chains.insert(
        "plain".to_owned(),
        read_chain(&main.join("users/alice/usercert.pem")),
    );
    // The CA side (trust, CRLs) is the same for a proxy and for the plain user certificate, so
    // these are plain certificates (each proxy costs an RSA key generation).
    for (name, file) in [
        ("expired_user", main.join("users/expired/usercert.pem")),
        ("revoked", main.join("users/bob/usercert.pem")),
        ("unknown_ca", other.join("users/mallory/usercert.pem")),
        ("stale_crl", stale.join("users/carol/usercert.pem")),
    ] {
        chains.insert(name.to_owned(), read_chain(&file));
    }
    eprintln!(
        "x509 fixture: {} chains in {} in {:.1}s",
        chains.len(),
        dir.display(),
        started.elapsed().as_secs_f64()
    );
    Fixture { dir, chains }
}

/// Chains that break one rule each, made with openssl from alice's credentials (and the
/// grid-proxy-init limited proxy, which must exist).
fn broken_chains(dir: &Path, main: &Path, key: &Path) {
    let alice_cert = main.join("users/alice/usercert.pem");
    let ca = Signer {
        cert: main.join("ca/ca.pem"),
        key: main.join("ca/ca.key"),
        chain: vec![],
    };
    let alice_signer = Signer {
        cert: alice_cert.clone(),
        key: main.join("users/alice/userkey.pem"),
        chain: vec![alice_cert.clone()],
    };
    let d = |name: &str| dir.join(format!("{name}.pem"));
    let from_file = |name: &str| Signer {
        cert: d(name),
        key: d(name),
        chain: vec![d(name)],
    };
    let pci = "proxyCertInfo=critical,language:id-ppl-inheritAll";
    let a = alice();
    let make = |name: &str, by: &Signer, subject: &str, ext: &str| {
        make_cert(dir, key, name, by, subject, ext);
    };
    make("ossl_ok", &alice_signer, &format!("{a}/CN=1001"), pci);
    make(
        "noncritical_pci",
        &alice_signer,
        &format!("{a}/CN=1002"),
        "proxyCertInfo=language:id-ppl-inheritAll",
    );
    // openssl writes one extension per OID, so the second PCI goes in under the look-alike OID
    // 1.3.6.1.5.5.7.1.99, which is then patched to .14 and the certificate signed again.
    make(
        "two_pcis",
        &alice_signer,
        &format!("{a}/CN=1003"),
        &format!("{pci}\n1.3.6.1.5.5.7.1.99=critical,DER:300C300A06082B06010505071501"),
    );
    patch_and_resign(
        &d("two_pcis"),
        &[0x06, 0x08, 0x2b, 0x06, 0x01, 0x05, 0x05, 0x07, 0x01, 0x63],
        &[0x06, 0x08, 0x2b, 0x06, 0x01, 0x05, 0x05, 0x07, 0x01, 0x0e],
        &main.join("users/alice/userkey.pem"),
    );
    make(
        "extra_rdn",
        &alice_signer,
        &format!("{a}/CN=1004/CN=1005"),
        pci,
    );
    make(
        "other_base",
        &alice_signer,
        &format!("{BASE}/OU=People/CN=eve/CN=1006"),
        pci,
    );
    make(
        "two_attr_rdn",
        &alice_signer,
        &format!("{a}/CN=1007+CN=1008"),
        pci,
    );
    make("ou_rdn", &alice_signer, &format!("{a}/OU=1009"), pci);
    make(
        "san",
        &alice_signer,
        &format!("{a}/CN=1010"),
        &format!("{pci}\nsubjectAltName=DNS:example.org"),
    );
    make(
        "ian",
        &alice_signer,
        &format!("{a}/CN=1011"),
        &format!("{pci}\nissuerAltName=DNS:example.org"),
    );
    make(
        "proxy_ca",
        &alice_signer,
        &format!("{a}/CN=1012"),
        &format!("{pci}\nbasicConstraints=critical,CA:TRUE"),
    );
    make(
        "ossl_pl0",
        &alice_signer,
        &format!("{a}/CN=1013"),
        "proxyCertInfo=critical,language:id-ppl-inheritAll,pathlen:0",
    );
    make(
        "ossl_pl0_child",
        &from_file("ossl_pl0"),
        &format!("{a}/CN=1013/CN=1014"),
        pci,
    );
    let limited_subject = dn_of(&read_chain(&d("limited"))[0]).unwrap();
    make(
        "full_from_limited",
        &from_file("limited"),
        &format!("{limited_subject}/CN=1015"),
        pci,
    );
    make(
        "unknown_language",
        &alice_signer,
        &format!("{a}/CN=1016"),
        "proxyCertInfo=critical,language:1.3.6.1.4.1.99999.1",
    );
    make(
        "unknown_critical",
        &alice_signer,
        &format!("{a}/CN=1017"),
        &format!("{pci}\n1.3.6.1.4.1.99999.2=critical,DER:0500"),
    );
    // A look-alike of alice's certificate with another key: proxies it signs name alice as
    // issuer but do not verify with alice's key.
    let fake_alice = dir.join("work/fake_alice.crt");
    std::fs::create_dir_all(dir.join("work")).unwrap();
    openssl(&[
        "req",
        "-new",
        "-x509",
        "-key",
        &key.display().to_string(),
        "-subj",
        &a,
        "-days",
        "1",
        "-out",
        &fake_alice.display().to_string(),
    ]);
    let forger = Signer {
        cert: fake_alice,
        key: key.to_owned(),
        chain: vec![alice_cert.clone()],
    };
    make("bad_signature", &forger, &format!("{a}/CN=1018"), pci);
    // User certificates the CA should not have issued, with a proxy each.
    make(
        "ca_user",
        &ca,
        &format!("{BASE}/OU=People/CN=capable"),
        "basicConstraints=critical,CA:TRUE\nkeyUsage=critical,digitalSignature,keyCertSign",
    );
    make(
        "proxy_of_ca",
        &from_file("ca_user"),
        &format!("{BASE}/OU=People/CN=capable/CN=1019"),
        pci,
    );
    make(
        "nodigsig_user",
        &ca,
        &format!("{BASE}/OU=People/CN=nodigsig"),
        "basicConstraints=critical,CA:FALSE\nkeyUsage=critical,keyEncipherment",
    );
    make(
        "proxy_of_nodigsig",
        &from_file("nodigsig_user"),
        &format!("{BASE}/OU=People/CN=nodigsig/CN=1020"),
        pci,
    );
    make(
        "odd_names",
        &ca,
        "/C=DE/ST=Baden-Wuerttemberg/L=Karlsruhe/O=GridKa+OU=SCC/UID=x42/serialNumber=7/emailAddress=a@b.example/CN=Odd Person",
        "basicConstraints=critical,CA:FALSE\nkeyUsage=critical,digitalSignature,keyEncipherment",
    );
}

fn read_chain(path: &Path) -> Vec<Vec<u8>> {
    let pem = std::fs::read(path).unwrap();
    read_pem_chain(&pem).unwrap().0
}

/// Who signs a certificate made with openssl: a certificate and key (files), and the chain
/// files written after the new certificate.
struct Signer {
    cert: PathBuf,
    key: PathBuf,
    chain: Vec<PathBuf>,
}

static SERIAL: AtomicU32 = AtomicU32::new(5000);

/// Makes `dir/name.pem`: a certificate for `subject` with the shared key, signed by `by`, with
/// the extension lines `ext`; then the key; then the signer's chain (a proxy-file layout).
fn make_cert(dir: &Path, key: &Path, name: &str, by: &Signer, subject: &str, ext: &str) {
    let work = dir.join("work");
    std::fs::create_dir_all(&work).unwrap();
    let ext_file = work.join(format!("{name}.cnf"));
    std::fs::write(&ext_file, format!("[ext]\n{ext}\n")).unwrap();
    let csr = work.join(format!("{name}.csr"));
    let cert = work.join(format!("{name}.crt"));
    openssl(&[
        "req",
        "-new",
        "-key",
        &key.display().to_string(),
        "-subj",
        subject,
        "-multivalue-rdn",
        "-out",
        &csr.display().to_string(),
    ]);
    let serial = SERIAL.fetch_add(1, Ordering::Relaxed).to_string();
    openssl(&[
        "x509",
        "-req",
        "-in",
        &csr.display().to_string(),
        "-CA",
        &by.cert.display().to_string(),
        "-CAkey",
        &by.key.display().to_string(),
        "-set_serial",
        &serial,
        "-days",
        "1",
        "-sha256",
        "-extfile",
        &ext_file.display().to_string(),
        "-extensions",
        "ext",
        "-out",
        &cert.display().to_string(),
    ]);
    let mut out = std::fs::read_to_string(&cert).unwrap();
    out.push_str(&std::fs::read_to_string(key).unwrap());
    for file in &by.chain {
        let (certs, _) = read_pem_chain(&std::fs::read(file).unwrap()).unwrap();
        for der in certs {
            out.push_str(&pem("CERTIFICATE", &der));
        }
    }
    std::fs::write(dir.join(format!("{name}.pem")), out).unwrap();
}

/// Replaces `from` by `to` (same length) in the first certificate of a PEM file and signs it
/// again with `key` (RSA, SHA-256), keeping the rest of the file.
fn patch_and_resign(file: &Path, from: &[u8], to: &[u8], key: &Path) {
    let text = std::fs::read_to_string(file).unwrap();
    let (mut certs, _) = read_pem_chain(text.as_bytes()).unwrap();
    let mut der = certs[0].clone();
    let (tbs_start, tbs_len, sig_len) = {
        let (_, cert) = X509Certificate::from_der(&der).unwrap();
        let tbs = cert.tbs_certificate.as_ref();
        (
            tbs.as_ptr() as usize - der.as_ptr() as usize,
            tbs.len(),
            cert.signature_value.data.len(),
        )
    };
    let at = der[tbs_start..tbs_start + tbs_len]
        .windows(from.len())
        .position(|w| w == from)
        .expect("bytes to patch not found")
        + tbs_start;
    der[at..at + to.len()].copy_from_slice(to);
    let work = file.with_extension("tbs");
    std::fs::write(&work, &der[tbs_start..tbs_start + tbs_len]).unwrap();
    let sig_file = file.with_extension("sig");
    openssl(&[
        "dgst",
        "-sha256",
        "-sign",
        &key.display().to_string(),
        "-out",
        &sig_file.display().to_string(),
        &work.display().to_string(),
    ]);
    let signature = std::fs::read(&sig_file).unwrap();
    assert_eq!(signature.len(), sig_len);
    let end = der.len();
    der[end - sig_len..].copy_from_slice(&signature);
    certs[0] = der;
    let key_pem = text
        .find("-----BEGIN PRIVATE KEY-----")
        .map(|start| {
            let end = text.find("-----END PRIVATE KEY-----").unwrap() + 26;
            text[start..end].to_owned()
        })
        .unwrap_or_default();
    let mut out = pem("CERTIFICATE", &certs[0]);
    out.push_str(&key_pem);
    for der in &certs[1..] {
        out.push_str(&pem("CERTIFICATE", der));
    }
    std::fs::write(file, out).unwrap();
}

fn pem(label: &str, der: &[u8]) -> String {
    let b64 = base64_encode(der);
    let mut out = format!("-----BEGIN {label}-----\n");
    for line in b64.as_bytes().chunks(64) {
        out.push_str(std::str::from_utf8(line).unwrap());
        out.push('\n');
    }
    let _ = writeln!(out, "-----END {label}-----");
    out
}

fn base64_encode(data: &[u8]) -> String {
    const ALPHABET: &[u8] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    let mut out = String::new();
    for chunk in data.chunks(3) {
        let b = [
            chunk[0],
            *chunk.get(1).unwrap_or(&0),
            *chunk.get(2).unwrap_or(&0),
        ];
        let n = (u32::from(b[0]) << 16) | (u32::from(b[1]) << 8) | u32::from(b[2]);
        for i in 0..4 {
            if i <= chunk.len() {
                out.push(char::from(ALPHABET[((n >> (18 - 6 * i)) & 63) as usize]));
            } else {
                out.push('=');
            }
        }
    }
    out
}

fn not_after(der: &[u8]) -> DateTime<Utc> {
    let (_, cert) = X509Certificate::from_der(der).unwrap();
    DateTime::from_timestamp(cert.validity().not_after.timestamp(), 0).unwrap()
}

fn not_before(der: &[u8]) -> DateTime<Utc> {
    let (_, cert) = X509Certificate::from_der(der).unwrap();
    DateTime::from_timestamp(cert.validity().not_before.timestamp(), 0).unwrap()
}

// ---------------------------------------------------------------------------------------------
// Chains that verify

#[test]
fn a_plain_user_certificate_verifies() {
    let v = verify("plain").unwrap();
    assert_eq!(v.kind, ProxyKind::EndEntity);
    assert_eq!(v.identity.as_str(), alice());
    assert_eq!(v.end_entity_subject.as_str(), alice());
    assert_eq!(
        v.end_entity_issuer.as_str(),
        format!("{BASE}/CN=ongrid test CA")
    );
    assert_eq!(v.depth, 0);
    assert!(v.voms_der.is_empty());
    assert!(v.warnings.is_empty(), "{:?}", v.warnings);
}

#[test]
fn an_rfc_proxy_is_its_user() {
    let chain = fixture().chain("rfc");
    let v = verify("rfc").unwrap();
    assert_eq!(v.kind, ProxyKind::Impersonation);
    assert_eq!(v.identity.as_str(), alice());
    assert_eq!(v.depth, 1);
    assert_eq!(v.not_after, not_after(&chain[0]).min(not_after(&chain[1])));
    let (_, leaf) = X509Certificate::from_der(&chain[0]).unwrap();
    assert_eq!(v.leaf_public_key_spki, leaf.public_key().raw);
}

#[test]
fn a_proxy_of_a_proxy_is_its_user() {
    let v = verify("rfc_2nd").unwrap();
    assert_eq!(v.kind, ProxyKind::Impersonation);
    assert_eq!(v.identity.as_str(), alice());
    assert_eq!(v.depth, 2);
}

#[test]
fn the_chain_may_come_in_any_order_after_the_leaf_and_with_the_ca() {
    let f = fixture();
    let mut chain = f.chain("rfc_2nd");
    chain.reverse();
    let leaf = chain.pop().unwrap();
    chain.insert(0, leaf);
    let ca = read_chain(&f.dir.join("main/ca/ca.pem"));
    chain.insert(1, ca[0].clone());
    let v = verify_chain(&chain, &f.main_cas(), &opts()).unwrap();
    assert_eq!(v.depth, 2);
    assert_eq!(v.identity.as_str(), alice());
}

#[test]
fn limited_proxies_and_their_proxies_are_limited() {
    let v = verify("limited").unwrap();
    assert_eq!(v.kind, ProxyKind::Limited);
    assert_eq!(v.identity.as_str(), alice());
    let v = verify("from_limited").unwrap();
    assert_eq!(v.kind, ProxyKind::Limited);
    assert_eq!(v.depth, 2);
}

#[test]
fn an_independent_proxy_has_its_own_identity() {
    let chain = fixture().chain("independent");
    let v = verify("independent").unwrap();
    assert_eq!(v.kind, ProxyKind::Independent);
    assert_eq!(v.identity, dn_of(&chain[0]).unwrap());
    assert!(v.identity.as_str().starts_with(&format!("{}/CN=", alice())));
    assert_eq!(v.end_entity_subject.as_str(), alice());

    let strict = VerifyOptions {
        allow_independent: false,
        ..opts()
    };
    let err = verify_chain(&chain, &fixture().main_cas(), &strict).unwrap_err();
    assert!(
        matches!(err, ChainError::IndependentNotAllowed { .. }),
        "{err}"
    );
}

#[test]
fn path_length_one_allows_one_proxy_below() {
    assert_eq!(verify("pl1").unwrap().depth, 1);
    assert_eq!(verify("pl1_a").unwrap().depth, 2);
    let err = verify("pl1_b").unwrap_err();
    assert!(matches!(err, ChainError::PathLenExceeded { .. }), "{err}");
}

#[test]
fn path_length_zero_allows_no_proxy_below() {
    assert_eq!(verify("pl0").unwrap().depth, 1);
    let err = verify("pl0_child").unwrap_err();
    assert!(matches!(err, ChainError::PathLenExceeded { .. }), "{err}");
    // The same with openssl's encoding.
    assert_eq!(verify("ossl_pl0").unwrap().depth, 1);
    let err = verify("ossl_pl0_child").unwrap_err();
    assert!(matches!(err, ChainError::PathLenExceeded { .. }), "{err}");
}

#[test]
fn an_openssl_made_proxy_verifies() {
    // The control for the broken openssl-made chains below.
    let v = verify("ossl_ok").unwrap();
    assert_eq!(v.kind, ProxyKind::Impersonation);
    assert_eq!(v.identity.as_str(), alice());
}

#[test]
fn a_proxy_file_reads_with_its_key() {
    let pem = std::fs::read(fixture().dir.join("rfc_2nd.pem")).unwrap();
    let (certs, key) = read_pem_chain(&pem).unwrap();
    assert_eq!(certs.len(), 3);
    assert!(key.is_some());
    assert_eq!(dn_of(&certs[2]).unwrap().as_str(), alice());
    assert!(read_pem_chain(b"no pem here").is_err());
}

// ---------------------------------------------------------------------------------------------
// Time

#[test]
fn an_expired_proxy_says_when_and_how_to_renew() {
    let chain = fixture().chain("short");
    let expiry = not_after(&chain[0]);
    assert!(
        verify_at("short", expiry + Duration::minutes(4)).is_ok(),
        "5 minutes of skew"
    );
    let err = verify_at("short", expiry + Duration::minutes(7)).unwrap_err();
    assert!(matches!(err, ChainError::ProxyExpired { .. }), "{err}");
    let text = err.to_string();
    assert!(text.starts_with("proxy expired at "), "{text}");
    assert!(text.contains("voms-proxy-init"), "{text}");
    assert!(
        text.contains(&expiry.format("%Y-%m-%d %H:%M UTC").to_string()),
        "{text}"
    );
}

#[test]
fn a_proxy_not_yet_valid_beyond_the_skew_is_refused() {
    let chain = fixture().chain("rfc");
    let start = not_before(&chain[0]);
    assert!(verify_at("rfc", start - Duration::minutes(4)).is_ok());
    let err = verify_at("rfc", start - Duration::minutes(10)).unwrap_err();
    match &err {
        ChainError::NotYetValid { subject, .. } => assert_ne!(subject, &alice()),
        other => panic!("expected NotYetValid, got {other}"),
    }
}

#[test]
fn an_expired_user_certificate_is_refused() {
    let err = verify("expired_user").unwrap_err();
    assert!(
        matches!(err, ChainError::CertificateExpired { .. }),
        "{err}"
    );
    assert!(err.to_string().contains("2021-01-01 00:00 UTC"), "{err}");
}

// ---------------------------------------------------------------------------------------------
// Trust: CA directory and CRLs

#[test]
fn a_user_of_an_unknown_ca_is_refused_naming_the_issuer_and_directory() {
    let err = verify("unknown_ca").unwrap_err();
    assert!(matches!(err, ChainError::UnknownCa { .. }), "{err}");
    let text = err.to_string();
    assert!(text.contains(&format!("{BASE}/CN=other test CA")), "{text}");
    assert!(text.contains("main/certificates"), "{text}");
}

#[test]
fn a_revoked_user_is_refused() {
    let err = verify("revoked").unwrap_err();
    assert!(matches!(err, ChainError::Revoked { .. }), "{err}");
}

#[test]
fn a_crl_past_next_update_refuses_or_warns() {
    let f = fixture();
    let cas = CaDir::load(&f.dir.join("stale/certificates")).unwrap();
    let chain = f.chain("stale_crl");
    let now = Utc::now();
    assert!(verify_chain(&chain, &cas, &VerifyOptions::at(now)).is_ok());
    let later = now + Duration::hours(3);
    let err = verify_chain(&chain, &cas, &VerifyOptions::at(later)).unwrap_err();
    assert!(matches!(err, ChainError::CrlExpired { .. }), "{err}");
    assert!(err.to_string().contains("fetch-crl"), "{err}");
    let warn = VerifyOptions {
        crl_policy: CrlPolicy::Warn,
        ..VerifyOptions::at(later)
    };
    let v = verify_chain(&chain, &cas, &warn).unwrap();
    assert_eq!(v.warnings.len(), 1, "{:?}", v.warnings);
    assert!(v.warnings[0].contains("out of date"), "{:?}", v.warnings);
}

#[test]
fn the_ca_directory_offers_its_subjects() {
    let cas = fixture().main_cas();
    assert_eq!(cas.len(), 1);
    assert!(cas.warnings().is_empty(), "{:?}", cas.warnings());
    let ca = read_chain(&fixture().dir.join("main/ca/ca.pem"));
    let (_, parsed) = X509Certificate::from_der(&ca[0]).unwrap();
    assert_eq!(cas.subjects(), vec![parsed.subject().as_raw().to_vec()]);
}

#[test]
fn a_forged_signature_is_refused() {
    let err = verify("bad_signature").unwrap_err();
    assert!(matches!(err, ChainError::BadSignature { .. }), "{err}");
    // And a flipped bit in a real proxy's signature.
    let f = fixture();
    let mut chain = f.chain("rfc");
    let last = chain[0].len() - 1;
    chain[0][last] ^= 1;
    let err = verify_chain(&chain, &f.main_cas(), &opts()).unwrap_err();
    assert!(matches!(err, ChainError::BadSignature { .. }), "{err}");
}

// ---------------------------------------------------------------------------------------------
// RFC 3820 rules, one broken chain each

fn assert_refused(name: &str, check: fn(&ChainError) -> bool) {
    let err = verify(name).unwrap_err();
    assert!(check(&err), "{name}: unexpected error {err:?}");
}

#[test]
fn legacy_and_draft_proxies_say_to_use_rfc() {
    let err = verify("legacy").unwrap_err();
    assert!(matches!(err, ChainError::LegacyProxy { .. }), "{err}");
    assert!(err.to_string().contains("-rfc"), "{err}");
    let err = verify("draft").unwrap_err();
    assert!(matches!(err, ChainError::DraftProxy { .. }), "{err}");
    assert!(err.to_string().contains("grid-proxy-init -rfc"), "{err}");
}

#[test]
fn rsa_keys_below_2048_bits_are_refused() {
    let err = verify("rsa1024").unwrap_err();
    assert!(
        matches!(
            err,
            ChainError::WeakKey {
                bits: 1024,
                min: 2048,
                ..
            }
        ),
        "{err}"
    );
    assert!(err.to_string().contains("2048"), "{err}");
    // A proxy below the weak one names the weak one.
    let err = verify("below_1024").unwrap_err();
    assert!(
        matches!(err, ChainError::WeakKey { bits: 1024, .. }),
        "{err}"
    );
    // A site that lowers the minimum accepts both (signatures by 1024-bit keys verify).
    let f = fixture();
    let lenient = VerifyOptions {
        min_rsa_bits: 1024,
        ..opts()
    };
    assert_eq!(
        verify_chain(&f.chain("below_1024"), &f.main_cas(), &lenient)
            .unwrap()
            .depth,
        2
    );
}

#[test]
fn proxy_cert_info_must_be_critical() {
    assert_refused("noncritical_pci", |e| {
        matches!(e, ChainError::NonCriticalPci { .. })
    });
}

#[test]
fn proxy_cert_info_must_be_there_once() {
    assert_refused("two_pcis", |e| matches!(e, ChainError::DuplicatePci { .. }));
}

#[test]
fn the_proxy_subject_is_the_issuer_plus_one_cn() {
    for name in ["extra_rdn", "other_base", "two_attr_rdn", "ou_rdn"] {
        assert_refused(name, |e| matches!(e, ChainError::ProxySubject { .. }));
    }
}

#[test]
fn the_proxy_issuer_must_not_be_a_ca() {
    assert_refused("proxy_of_ca", |e| {
        matches!(e, ChainError::IssuerIsCa { .. })
    });
    // Presented alone, such a certificate is not a user certificate.
    let f = fixture();
    let chain = vec![f.chain("ca_user")[0].clone()];
    let err = verify_chain(&chain, &f.main_cas(), &opts()).unwrap_err();
    assert!(matches!(err, ChainError::EndEntityIsCa { .. }), "{err}");
}

#[test]
fn the_proxy_issuer_must_allow_digital_signatures() {
    assert_refused("proxy_of_nodigsig", |e| {
        matches!(e, ChainError::IssuerKeyUsage { .. })
    });
}

#[test]
fn proxies_have_no_alternative_names() {
    assert_refused(
        "san",
        |e| matches!(e, ChainError::ProxyAltName { extension, .. } if extension == "subjectAltName"),
    );
    assert_refused(
        "ian",
        |e| matches!(e, ChainError::ProxyAltName { extension, .. } if extension == "issuerAltName"),
    );
}

#[test]
fn a_proxy_is_not_a_ca() {
    assert_refused("proxy_ca", |e| matches!(e, ChainError::ProxyIsCa { .. }));
}

#[test]
fn a_full_proxy_from_a_limited_one_is_refused() {
    assert_refused("full_from_limited", |e| {
        matches!(e, ChainError::FullProxyFromLimited { .. })
    });
}

#[test]
fn unknown_policy_languages_are_refused() {
    assert_refused(
        "unknown_language",
        |e| matches!(e, ChainError::UnknownPolicyLanguage { oid, .. } if oid == "1.3.6.1.4.1.99999.1"),
    );
}

#[test]
fn unknown_critical_extensions_are_refused() {
    assert_refused(
        "unknown_critical",
        |e| matches!(e, ChainError::UnknownCriticalExtension { oid, .. } if oid == "1.3.6.1.4.1.99999.2"),
    );
}

#[test]
fn a_proxy_without_its_user_certificate_is_refused() {
    let f = fixture();
    let chain = vec![f.chain("rfc_2nd")[0].clone(), f.chain("rfc_2nd")[1].clone()];
    let err = verify_chain(&chain, &f.main_cas(), &opts()).unwrap_err();
    assert!(matches!(err, ChainError::MissingIssuer { .. }), "{err}");
}

#[test]
fn empty_and_garbage_chains_are_refused() {
    let cas = fixture().main_cas();
    assert_eq!(
        verify_chain(&[], &cas, &opts()).unwrap_err(),
        ChainError::Empty
    );
    let err = verify_chain(&[vec![0x30, 0x03, 1, 2, 3]], &cas, &opts()).unwrap_err();
    assert!(
        matches!(err, ChainError::Malformed { index: 0, .. }),
        "{err}"
    );
}

// ---------------------------------------------------------------------------------------------
// VOMS

#[test]
fn voms_attributes_are_read_from_a_trusted_ac() {
    let f = fixture();
    let v = verify("voms").unwrap();
    assert_eq!(v.voms_der.len(), 1);
    let (attributes, warnings) = voms::attributes(&v, &f.main_cas(), &f.vomsdir(), Utc::now());
    assert!(warnings.is_empty(), "{warnings:?}");
    assert_eq!(attributes.len(), 1);
    let a = &attributes[0];
    assert_eq!(a.vo, VO);
    assert_eq!(a.issuer.as_str(), format!("{BASE}/CN={VOMS_HOST}"));
    assert_eq!(a.uri, format!("{VOMS_HOST}:15000"));
    let fqans: Vec<String> = a.fqans.iter().map(Fqan::to_string).collect();
    assert_eq!(fqans, ["/testvo", "/testvo/prod/Role=admin"]);
    assert!(a.fqans[1].matches(&Fqan::parse("/testvo/prod/Role=admin").unwrap()));
    assert!(!a.fqans[0].matches(&Fqan::parse("/testvo/Role=admin").unwrap()));
}

#[test]
fn voms_attributes_survive_a_further_proxy() {
    let f = fixture();
    let v = verify("voms_2nd").unwrap();
    assert_eq!(v.depth, 2);
    let (attributes, warnings) = voms::attributes(&v, &f.main_cas(), &f.vomsdir(), Utc::now());
    assert!(warnings.is_empty(), "{warnings:?}");
    assert_eq!(attributes[0].vo, VO);
}

#[test]
fn an_expired_ac_is_a_warning_not_an_error() {
    let f = fixture();
    let v = verify("voms_expired_ac").unwrap();
    assert_eq!(v.identity.as_str(), alice());
    let (attributes, warnings) = voms::attributes(&v, &f.main_cas(), &f.vomsdir(), Utc::now());
    assert!(attributes.is_empty());
    assert_eq!(warnings.len(), 1);
    assert!(warnings[0].contains("expired"), "{warnings:?}");
    assert!(warnings[0].contains("voms-proxy-init"), "{warnings:?}");
}

#[test]
fn an_ac_from_an_untrusted_voms_server_is_a_warning() {
    let f = fixture();
    let v = verify("voms_untrusted").unwrap();
    let (attributes, warnings) = voms::attributes(&v, &f.main_cas(), &f.vomsdir(), Utc::now());
    assert!(attributes.is_empty());
    assert_eq!(warnings.len(), 1, "{warnings:?}");
    assert!(warnings[0].contains(ROGUE_HOST), "{warnings:?}");
    assert!(warnings[0].contains(".lsc"), "{warnings:?}");
}

#[test]
fn an_old_style_vomsdir_with_the_server_certificate_works() {
    let f = fixture();
    let old = f.dir.join("old_vomsdir");
    std::fs::create_dir_all(&old).unwrap();
    std::fs::copy(
        f.dir.join(format!("main/voms/{VOMS_HOST}/hostcert.pem")),
        old.join("voms.pem"),
    )
    .unwrap();
    let v = verify("voms").unwrap();
    let vomsdir = VomsDir::load(&old).unwrap();
    let (attributes, warnings) = voms::attributes(&v, &f.main_cas(), &vomsdir, Utc::now());
    assert!(warnings.is_empty(), "{warnings:?}");
    assert_eq!(attributes.len(), 1);
    // An empty vomsdir trusts nobody.
    let empty = f.dir.join("empty_vomsdir");
    std::fs::create_dir_all(&empty).unwrap();
    let (attributes, warnings) = voms::attributes(
        &v,
        &f.main_cas(),
        &VomsDir::load(&empty).unwrap(),
        Utc::now(),
    );
    assert!(attributes.is_empty());
    assert_eq!(warnings.len(), 1);
}

#[test]
fn a_voms_ac_for_another_holder_is_dropped() {
    // Alice's AC bytes on a chain with another EEC serial: the holder does not match.
    let f = fixture();
    let alice_v = verify("voms").unwrap();
    let mut other = verify("rfc").unwrap();
    other.end_entity_serial = vec![0x7f];
    other.voms_der = alice_v.voms_der.clone();
    let (attributes, warnings) = voms::attributes(&other, &f.main_cas(), &f.vomsdir(), Utc::now());
    assert!(attributes.is_empty());
    assert!(warnings[0].contains("another certificate"), "{warnings:?}");
}

#[test]
fn the_ac_parser_reads_what_voms_proxy_fake_wrote() {
    let v = verify("voms").unwrap();
    let acs = voms::parse_ac_extension(&v.voms_der[0]).unwrap();
    assert_eq!(acs.len(), 1);
    assert_eq!(acs[0].vo.as_deref(), Some(VO));
    assert_eq!(
        acs[0].fqans,
        [
            "/testvo/Role=NULL/Capability=NULL",
            "/testvo/prod/Role=admin/Capability=NULL"
        ]
    );
    assert!(voms::parse_ac_extension(&[0x30, 0x00]).is_err());
}

// ---------------------------------------------------------------------------------------------
// DNs

#[test]
fn dn_of_matches_openssl_oneline() {
    let f = fixture();
    for name in ["odd_names", "rfc_2nd", "plain", "independent"] {
        let file = f.dir.join(format!("{name}.pem"));
        let file = if name == "plain" {
            f.dir.join("main/users/alice/usercert.pem")
        } else {
            file
        };
        let expected = openssl(&[
            "x509",
            "-in",
            &file.display().to_string(),
            "-noout",
            "-subject",
            "-nameopt",
            "compat",
        ]);
        let expected = expected.trim().trim_start_matches("subject=");
        let chain = f.chain(name);
        assert_eq!(dn_of(&chain[0]).unwrap().as_str(), expected, "{name}");
    }
}
