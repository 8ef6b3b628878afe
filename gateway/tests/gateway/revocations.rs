//! Open connections of a key removed meanwhile are closed with the manager's message, and only
//! those: another user's connection stays.

use std::process::Stdio;
use std::time::Duration;

use ongrid_core::api::{ConnectionEventKind, KeyOwner};
use ongrid_core::{Dn, UserName};

use crate::harness::{self, eventually, text, Env, Options, SshKey};

const BOB_DN: &str = "/DC=org/DC=example/CN=Bob";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_open_connection_of_a_removed_key_is_closed_with_a_message() {
    let env = Env::start(Options::default()).await;
    let bob = SshKey::generate(env.dir.path(), "bob");
    env.manager.keys.lock().unwrap().insert(
        harness::key_id(&bob.public),
        KeyOwner {
            owner: Dn::parse(BOB_DN).unwrap(),
            user_name: UserName::parse("bob").unwrap(),
            fingerprint: bob.fingerprint(),
            expires_at: chrono::Utc::now() + chrono::Duration::days(1),
        },
    );
    let open = |key: &SshKey| {
        let mut ssh = env.ssh(key, "train1", env.gateway.port());
        ssh.arg("sleep 600")
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        ssh.spawn().unwrap()
    };
    let mut alice_ssh = open(&env.alice);
    // Held open: `wait_with_output` would close it, and the command end at EOF.
    let _alice_stdin = alice_ssh.stdin.take().unwrap();
    let mut bob_ssh = open(&bob);
    eventually("both connections open", || async {
        let opens = env
            .manager
            .events()
            .iter()
            .filter(|e| e.event == ConnectionEventKind::Open)
            .count();
        (opens == 2).then_some(())
    })
    .await;

    env.manager
        .keys
        .lock()
        .unwrap()
        .remove(&harness::key_id(&env.alice.public));
    let removed = tokio::time::Instant::now();
    let out = tokio::time::timeout(Duration::from_secs(10), alice_ssh.wait_with_output())
        .await
        .expect("Alice's connection is closed")
        .unwrap();
    let took = removed.elapsed();
    assert!(took < Duration::from_millis(2500), "closed after {took:?}");
    assert_eq!(out.status.code(), Some(255), "{}", harness::explain(&out));
    let stderr = text(&out.stderr);
    let message = format!(
        "your SSH key {} was removed: run `devctl key add` to register a key again",
        env.alice.fingerprint()
    );
    assert!(stderr.contains(&format!("ongrid: {message}")), "{stderr}");

    // The close is reported with the reason; Bob's connection is untouched.
    let close = eventually("Alice's close event", || async {
        env.manager
            .events()
            .into_iter()
            .find(|e| e.event == ConnectionEventKind::Close)
    })
    .await;
    assert_eq!(close.owner.as_str(), harness::ALICE_DN);
    assert_eq!(close.close_reason.as_deref(), Some(message.as_str()));
    assert_eq!(bob_ssh.try_wait().unwrap(), None, "Bob's ssh still runs");
    let mut stdin = bob_ssh.stdin.take().unwrap();
    tokio::io::AsyncWriteExt::write_all(&mut stdin, b"still here\n")
        .await
        .unwrap();
    drop(stdin);
    let out = tokio::time::timeout(Duration::from_secs(10), bob_ssh.wait_with_output())
        .await
        .expect("Bob's command ends at EOF")
        .unwrap();
    assert!(out.status.success(), "{}", harness::explain(&out));
    assert_eq!(text(&out.stdout), "still here\n");
    let closes: Vec<_> = env
        .manager
        .events()
        .into_iter()
        .filter(|e| e.event == ConnectionEventKind::Close)
        .collect();
    assert!(
        closes
            .iter()
            .all(|e| e.owner.as_str() == harness::ALICE_DN || e.close_reason.is_none()),
        "{closes:?}"
    );
}
