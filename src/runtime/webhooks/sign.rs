//! Standard Webhooks signatures: `webhook-signature: v1,<base64 HMAC-SHA256>` over
//! `{webhook-id}.{webhook-timestamp}.{body}` with the secret's key bytes
//! (<https://github.com/standard-webhooks/standard-webhooks/blob/main/spec/standard-webhooks.md>).

use base64::Engine;
use hmac::{Hmac, Mac};
use sha2::Sha256;

/// A keyed HMAC-SHA256, cloned for each signature.
#[derive(Clone)]
pub(super) struct Signer(Hmac<Sha256>);

impl std::fmt::Debug for Signer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Signer([redacted])")
    }
}

impl Signer {
    /// A signer with `key` (HMAC takes a key of any length; `None` never happens).
    pub(super) fn new(key: &[u8]) -> Option<Self> {
        Hmac::<Sha256>::new_from_slice(key).ok().map(Self)
    }

    /// The `webhook-signature` header's value for this message.
    pub(super) fn sign(&self, id: &str, timestamp: i64, body: &[u8]) -> String {
        let mut mac = self.0.clone();
        mac.update(id.as_bytes());
        mac.update(b".");
        mac.update(timestamp.to_string().as_bytes());
        mac.update(b".");
        mac.update(body);
        let signature = mac.finalize().into_bytes();
        format!(
            "v1,{}",
            base64::engine::general_purpose::STANDARD.encode(signature)
        )
    }
}

#[cfg(test)]
mod tests {
    use base64::Engine;

    use super::Signer;

    /// The example of the Standard Webhooks reference libraries' tests.
    #[test]
    fn signs_like_the_reference() {
        let key = base64::engine::general_purpose::STANDARD
            .decode("MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw")
            .unwrap();
        let signer = Signer::new(&key).unwrap();
        let signature = signer.sign(
            "msg_p5jXN8AQM9LWM0D4loKWxJek",
            1_614_265_330,
            br#"{"test": 2432232314}"#,
        );
        assert_eq!(signature, "v1,g0hM9SsE+OTPJTGt/tmIKtSyZlE3uFJELVlNIOLJ1OE=");
    }
}
