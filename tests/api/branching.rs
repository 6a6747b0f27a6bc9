//! Branching: regenerating and editing make siblings, and the active branch is the one the
//! next turn follows.

use serde_json::{Value, json};

use crate::helpers::*;

both_backends! {
    async fn regenerating_makes_a_sibling_and_the_next_turn_follows_the_active_branch(backend: Backend) {
        let app = TestApp::spawn(backend, "").await;
        let first = app.chat("ann", json!({"message": "Tell me"})).await;
        let conversation = first[0].data["conversation_id"].clone();
        let user_message = first[0].data["user_message_id"].clone();
        let old_answer = first[0].data["message_id"].clone();
        let again = app.chat("ann", json!({"message": "Tell me", "conversation_id": conversation, "parent_message_id": user_message})).await;
        assert_eq!(again[0].data["user_message_id"], user_message, "the same message, answered again");
        let new_answer = again[0].data["message_id"].clone();
        let (_, siblings) = app.get(&format!("/api/messages/{}/siblings", new_answer.as_str().unwrap()), "ann").await;
        let listed: Vec<(Value, bool)> = siblings["siblings"].as_array().unwrap().iter().map(|m| (m["id"].clone(), m["active"].as_bool().unwrap())).collect();
        assert_eq!(listed, vec![(old_answer.clone(), false), (new_answer.clone(), true)]);

        // Switch back to the first answer; the next turn continues from it.
        let (status, switched) = app.post(&format!("/api/messages/{}/activate", old_answer.as_str().unwrap()), "ann", json!({})).await;
        assert_eq!(status, 200, "{switched}");
        assert_eq!(switched["messages"][1]["id"], old_answer);
        let next = app.chat("ann", json!({"message": "Go on", "conversation_id": conversation})).await;
        let (_, loaded) = app.get(&format!("/api/conversations/{}", conversation.as_str().unwrap()), "ann").await;
        let ids: Vec<&Value> = loaded["messages"].as_array().unwrap().iter().map(|m| &m["id"]).collect();
        assert_eq!(ids, vec![&user_message, &old_answer, &next[0].data["user_message_id"], &next[0].data["message_id"]]);
        assert_eq!(loaded["message_count"], 5, "every branch's messages are kept");

        // An edit: other text for the first message makes a sibling user message.
        let edited = app.chat("ann", json!({"message": "Tell me more", "conversation_id": conversation, "parent_message_id": user_message})).await;
        let (_, loaded) = app.get(&format!("/api/conversations/{}", conversation.as_str().unwrap()), "ann").await;
        assert_eq!(loaded["messages"][0]["id"], edited[0].data["user_message_id"]);
        assert_eq!(loaded["messages"][0]["content"], "Tell me more");
        assert_eq!(loaded["messages"].as_array().unwrap().len(), 2);
    }
}
