//! Subscriptions and request/reply: the subscription handle, the shared reply inbox, and
//! the stream of replies to one request.

use std::time::Duration;

use futures_lite::future;

use super::super::error::NatsError;
use super::super::proto::{self, Msg, encode};
use super::{Client, SubEntry};

/// A subscription: its messages arrive on [`Subscription::next`]. Dropping it unsubscribes.
pub struct Subscription {
    sid: u64,
    rx: flume::Receiver<Msg>,
    client: Client,
}

impl std::fmt::Debug for Subscription {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Subscription")
            .field("sid", &self.sid)
            .finish()
    }
}

impl Subscription {
    /// The next message, or `None` once the client is closed.
    pub async fn next(&self) -> Option<Msg> {
        self.rx.recv_async().await.ok()
    }

    /// A message if one is waiting.
    pub fn try_next(&self) -> Option<Msg> {
        self.rx.try_recv().ok()
    }

    /// The subscription id.
    pub fn sid(&self) -> u64 {
        self.sid
    }
}

impl Drop for Subscription {
    fn drop(&mut self) {
        self.client.unsubscribe(self.sid);
    }
}

impl Client {
    /// Subscribes to `subject` (wildcards allowed), optionally in a queue group.
    pub fn subscribe(&self, subject: &str, queue: Option<&str>) -> Result<Subscription, NatsError> {
        if !proto::valid_subject(subject) {
            return Err(NatsError::InvalidSubject(subject.into()));
        }
        let (tx, rx) = flume::bounded(self.0.opts.subscription_capacity);
        let mut s = self.0.state.borrow_mut();
        if s.closed {
            return Err(NatsError::Closed);
        }
        let sid = s.next_sid;
        s.next_sid += 1;
        s.subs.insert(
            sid,
            SubEntry {
                subject: subject.into(),
                queue: queue.map(Into::into),
                tx,
            },
        );
        if s.connected {
            encode::subscribe(&mut s.out, subject, queue, sid);
        }
        drop(s);
        let _ = self.0.wake_writer.try_send(());
        Ok(Subscription {
            sid,
            rx,
            client: self.clone(),
        })
    }

    pub(super) fn unsubscribe(&self, sid: u64) {
        let mut s = self.0.state.borrow_mut();
        // Also while disconnected: the SUB may still wait in the buffer, to be sent after
        // the reconnect (the server ignores an UNSUB for an id it does not know).
        if s.subs.remove(&sid).is_some() && !s.closed {
            encode::unsubscribe(&mut s.out, sid, None);
            drop(s);
            let _ = self.0.wake_writer.try_send(());
        }
    }

    fn inbox(&self) -> Result<(String, flume::Receiver<Msg>, String), NatsError> {
        let mut s = self.0.state.borrow_mut();
        if s.closed {
            return Err(NatsError::Closed);
        }
        if s.inbox_sid.is_none() {
            let sid = s.next_sid;
            s.next_sid += 1;
            let subject = format!("{}.*", s.inbox_prefix);
            // The inbox is a subscription like any other, so that it is re-subscribed on
            // reconnect; its channel is unused (replies are routed by token).
            let (tx, _rx) = flume::bounded(1);
            s.subs.insert(
                sid,
                SubEntry {
                    subject: subject.clone(),
                    queue: None,
                    tx,
                },
            );
            if s.connected {
                encode::subscribe(&mut s.out, &subject, None, sid);
            }
            s.inbox_sid = Some(sid);
        }
        let token = s.next_token.to_string();
        s.next_token += 1;
        let (tx, rx) = flume::bounded(1024);
        s.requests.insert(token.clone(), tx);
        let reply = format!("{}.{token}", s.inbox_prefix);
        Ok((reply, rx, token))
    }

    /// Sends a request and waits for the first reply.
    pub async fn request(
        &self,
        subject: &str,
        payload: &[u8],
        timeout: Duration,
    ) -> Result<Msg, NatsError> {
        let stream = self.request_stream(subject, payload).await?;
        let wait = async { stream.rx.recv_async().await.map_err(|_| NatsError::Closed) };
        let deadline = async {
            glommio::timer::sleep(timeout).await;
            Err(NatsError::Timeout)
        };
        let msg = future::or(wait, deadline).await?;
        if msg.status() == Some(503) {
            return Err(NatsError::NoResponders);
        }
        Ok(msg)
    }

    /// Sends a request whose answer may come as several messages (a chunked dump); they
    /// arrive on the returned stream until it is dropped.
    pub async fn request_stream(
        &self,
        subject: &str,
        payload: &[u8],
    ) -> Result<ReplyStream, NatsError> {
        let (reply, rx, token) = self.inbox()?;
        let _ = self.0.wake_writer.try_send(());
        let guard = ReplyStream {
            rx,
            token,
            client: self.clone(),
        };
        self.publish_with_reply(subject, Some(&reply), payload)
            .await?;
        Ok(guard)
    }
}

/// Replies to one request, as they arrive. Dropping it forgets the request.
pub struct ReplyStream {
    rx: flume::Receiver<Msg>,
    token: String,
    client: Client,
}

impl std::fmt::Debug for ReplyStream {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ReplyStream")
            .field("token", &self.token)
            .finish()
    }
}

impl ReplyStream {
    /// The next reply, or `Timeout`.
    pub async fn next(&self, timeout: Duration) -> Result<Msg, NatsError> {
        let wait = async { self.rx.recv_async().await.map_err(|_| NatsError::Closed) };
        let deadline = async {
            glommio::timer::sleep(timeout).await;
            Err(NatsError::Timeout)
        };
        let msg = future::or(wait, deadline).await?;
        if msg.status() == Some(503) {
            return Err(NatsError::NoResponders);
        }
        Ok(msg)
    }
}

impl Drop for ReplyStream {
    fn drop(&mut self) {
        self.client
            .0
            .state
            .borrow_mut()
            .requests
            .remove(&self.token);
    }
}
